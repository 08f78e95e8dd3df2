"""Sample from a trained MoH-DiT / DiT: the same as ``moh-dit sample`` (moh_dit/commands/sample.py; run with --help for the options)."""

from moh_dit.cli.sample import main

if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)
