"""The README's demo transcript agrees with a fresh `kvmiss demo` on everything the seed decides."""

from __future__ import annotations

from readme_demo import readme_transcript, run_demo, stable_form


def test_the_readme_transcript_is_what_the_demo_prints(tmp_path):
    fresh = run_demo(tmp_path / "kvmiss-demo-out")
    assert stable_form(readme_transcript()) == stable_form(fresh)
    assert "wrong verdicts: 0" in fresh


def test_masking_keeps_what_the_seed_decides():
    line = "hit               none               283              0"
    assert stable_form(line) == ["hit none 283 0"]
    assert stable_form("no_match          application        147          17696") == ["no_match application # #"]
    truth = "ground truth (x):\ntrue label         requests  agree  unknown  WRONG\nevicted                  27     24        3      0"
    assert stable_form(truth)[-1] == "evicted 27 # # 0"
