"""Train MoH-DiT or DiT: the same as ``moh-dit train`` (moh_dit/commands/train.py; run with --help for the options)."""

from moh_dit.cli.train import main

if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)
