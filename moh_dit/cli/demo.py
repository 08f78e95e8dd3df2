r"""Open a local web page to try a trained model: class (by name), guidance, steps, scheduler and seed; the
samples, and for MoH models which routed heads the tokens used. Needs the demo extra:
pip install "moh-dit[demo]".

    moh-dit demo runs/fashion_mnist_moh
    moh-dit demo pipelines/dit-xl-2-256 --port 7861 --device cuda --no-browser
"""

import argparse

from moh_dit.cli.common import positive_int
from moh_dit.logs import setup_logging
from moh_dit.sampling.caches import CACHES
from moh_dit.sampling.rules import RULES


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="run folder, checkpoint folder, pipeline folder or transformer folder")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default: this machine only)")
    p.add_argument("--port", type=positive_int, default=7860)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--vae",
        default=None,
        help="decode with this VAE (hub id or folder) instead of the model's own; it must share the model's latent space",
    )
    p.add_argument("--no-browser", action="store_true", help="do not open a browser window")
    g = p.add_argument_group("how the page guides (default: as the model records)")
    g.add_argument("--guide-model", default=None, metavar="PATH", help="autoguidance by this weaker model")
    g.add_argument("--guide-step", type=positive_int, default=None, help="the guide run's checkpoint at this step")
    g.add_argument("--guide-sigma-rel", type=float, default=None, help="the guide run's post-hoc EMA of this width")
    g.add_argument("--guidance-rule", choices=list(RULES), default=None, help=", ".join(RULES))
    g.add_argument(
        "--cache",
        choices=list(CACHES),
        default=None,
        help="a sampling cache with its default options (docs/sampling.md)",
    )
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    args = build_parser(prog).parse_args(argv)
    setup_logging()
    import os

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # the page is local; nothing is sent anywhere
    try:
        import gradio  # noqa: F401
    except ImportError:
        from moh_dit.errors import ConfigError

        raise ConfigError('the demo needs gradio: pip install "moh-dit[demo]"') from None
    from moh_dit.sampling.demo import build_demo
    from moh_dit.sampling.loading import load_pipeline

    pipe = load_pipeline(args.model, args.device, vae=args.vae)
    changes = {k: getattr(args, k) for k in ("guidance_rule", "cache") if getattr(args, k) is not None}
    if args.cache is not None:
        changes["cache_options"] = None  # the cache's defaults, not the options of the one the model records
    if args.guide_model is not None:
        changes.update(guide=args.guide_model, guide_step=args.guide_step, guide_sigma_rel=args.guide_sigma_rel)
    pipe.set_preview_sampling(pipe.preview_sampling.replace(**changes))
    pipe.check_sampling(pipe.preview_sampling)  # a guide that cannot guide stops here
    page = build_demo(pipe, title=f"MoH-DiT demo: {args.model}")
    page.launch(server_name=args.host, server_port=args.port, inbrowser=not args.no_browser, share=False)
