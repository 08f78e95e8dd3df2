"""Evaluate FID, sFID, IS, precision and recall: the same as ``moh-dit evaluate`` (moh_dit/commands/evaluate.py; run with --help for the options)."""

from moh_dit.cli.evaluate import main

if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)
