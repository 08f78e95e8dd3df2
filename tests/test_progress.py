"""Progress lines a user can follow: counts never pass the total, so neither share nor time left goes wrong."""

import re

from moh_dit.progress import Progress


def test_a_count_past_the_total_is_cut_and_the_last_line_says_done(capsys):
    bar = Progress(200, desc="encoding latents", unit="img", every_s=0.0)  # stderr is not a terminal: lines
    for _ in range(4):
        bar.update(64)  # two processes report 2 x 32 images a block: the last block overshoots
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("encoding latents: 200/200 img (100%)")
    assert all("eta 23:59:59" not in line for line in lines)
    assert re.search(r"eta 00:00:00$", lines[-1]) and bar.count == 200
