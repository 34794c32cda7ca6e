"""tools/bench/fragsim.py: the allocator designs it replays a trace through, on traces small enough to work out
by hand."""

from __future__ import annotations

import gzip

import pytest

from evalkit import load_bench

MIB = 1 << 20


@pytest.fixture(scope="module")
def fragsim():
    return load_bench("fragsim")


def _peaks(fragsim, ops, design, page=2 * MIB, passes=1):
    """Peak allocated, requested and reserved bytes."""
    return fragsim.replay(ops, lambda: fragsim.DESIGNS[design](page), passes)[:3]


# a 3 MiB, b 3 MiB, a freed (a 3 MiB hole at the bottom), c 4 MiB: the hole cannot take it
HOLE = [("a", 1, 3 * MIB), ("a", 2, 3 * MIB), ("f", 1, 0), ("a", 3, 4 * MIB), ("f", 2, 0), ("f", 3, 0)]


def test_segments_reserve_a_20_mib_segment_for_mid_sized_requests(fragsim):
    alloc, req, res = _peaks(fragsim, HOLE, "segments")
    assert (alloc, req, res) == (7 * MIB, 7 * MIB, 20 * MIB)  # c split off the 14 MiB tail
    # a remainder of 1 MiB or less stays with its block, counted as allocated
    ops = [("a", 1, 19 * MIB // 2), ("a", 2, 19 * MIB // 2)]
    assert _peaks(fragsim, ops, "segments") == (20 * MIB, 19 * MIB, 20 * MIB)


def test_expandable_grows_the_top_by_pages(fragsim):
    alloc, req, res = _peaks(fragsim, HOLE, "expandable1")
    assert (alloc, req) == (7 * MIB, 7 * MIB)
    assert res == 10 * MIB  # [0, 3) hole, b [3, 6), c [6, 10): five 2 MiB pages


def test_ideal_unmap_gives_back_the_pages_of_the_hole_before_growing(fragsim):
    _, _, res = _peaks(fragsim, HOLE, "ideal-unmap")
    assert res == 8 * MIB  # page [0, 2) unmapped before c; b's pages [2, 6) and c's [6, 10)


# a 4 MiB [0, 4), b 2 MiB [4, 6), a freed, c 6 MiB at the top [6, 12) (pages 0 and 1 unmapped first), b freed, d 3 MiB
# into the free [0, 6): its pages 0 and 1 are mapped again, page 2 (b's, free now) is unmapped first
REMAP = [("a", 1, 4 * MIB), ("a", 2, 2 * MIB), ("f", 1, 0), ("a", 3, 6 * MIB), ("f", 2, 0), ("a", 4, 3 * MIB),
         ("f", 3, 0), ("f", 4, 0)]


def test_ideal_unmap_unmaps_before_mapping_a_hole_again_and_counts_it(fragsim):
    a = fragsim.DESIGNS["ideal-unmap"](2 * MIB)
    assert fragsim.replay(REMAP, lambda: a, 1) == (9 * MIB, 9 * MIB, 10 * MIB, 6 * MIB)  # pages 0-1 and 2 unmapped
    _, _, res = _peaks(fragsim, REMAP, "expandable1")
    assert res == 12 * MIB  # nothing unmapped: pages 0-5
    # d of 6 MiB instead: it needs page 2 (b's, free) too, which stays mapped for it: only pages 0-1 were unmapped
    ops = [op if op[1] != 4 else ("a", 4, 6 * MIB) for op in REMAP]
    a = fragsim.DESIGNS["ideal-unmap"](2 * MIB)
    assert fragsim.replay(ops, lambda: a, 1)[3] == 4 * MIB


def test_mapped_first_takes_mapped_room_over_a_tighter_unmapped_block(fragsim):
    # a 5 MiB [0, 5), b 1 MiB [5, 6), c 4 MiB [6, 10), d 2 MiB [10, 12); c freed; e 8 MiB at the top unmaps c's pages
    # 3 and 4; a freed; f 4 MiB: the best fit by address is c's old [6, 10) (pages 3-4 mapped again after pages 0-1
    # are unmapped), mapped-first takes [0, 4), mapped already
    ops = [("a", 1, 5 * MIB), ("a", 2, MIB), ("a", 3, 4 * MIB), ("a", 4, 2 * MIB), ("f", 3, 0), ("a", 5, 8 * MIB),
           ("f", 1, 0), ("a", 6, 4 * MIB)]
    for design, unmapped in (("ideal-unmap", 8 * MIB), ("mapped-first", 4 * MIB)):
        a = fragsim.DESIGNS[design](2 * MIB)
        assert fragsim.replay(ops, lambda: a, 1) == (16 * MIB, 16 * MIB, 16 * MIB, unmapped), design


def test_a_request_that_fits_a_hole_reuses_it_in_every_design(fragsim):
    ops = [("a", 1, 4 * MIB), ("a", 2, 4 * MIB), ("f", 1, 0), ("a", 3, 3 * MIB), ("f", 2, 0), ("f", 3, 0)]
    for design in fragsim.DESIGNS:
        alloc, req, res = _peaks(fragsim, ops, design)
        assert req == 8 * MIB, design
        assert res <= (20 * MIB if design == "segments" else 8 * MIB), design


def test_blocks_live_at_the_end_of_a_pass_are_freed_before_the_next(fragsim):
    ops = [("a", 1, 3 * MIB)]  # never freed in the trace
    assert _peaks(fragsim, ops, "expandable1", passes=3) == (3 * MIB, 3 * MIB, 4 * MIB)


def test_the_command_line_reads_a_trace_and_names_bad_input(fragsim, tmp_path, capsys):
    path = tmp_path / "t.trace.gz"
    with gzip.open(path, "wt") as f:
        f.write("# a comment\n" + "".join(f"a {i} {n}\n" if op == "a" else f"f {i}\n" for op, i, n in HOLE))
    assert fragsim.main(["--trace", str(path), "--only", "expandable1"]) == 0
    out = capsys.readouterr().out
    assert "expandable1" in out and "30.0%" in out  # 1 - 7 / 10
    bad = tmp_path / "bad.trace"
    bad.write_text("a 1\n")
    with pytest.raises(ValueError, match="bad.trace:1"):
        fragsim.main(["--trace", str(bad)])
    with pytest.raises(SystemExit):
        fragsim.main(["--only", "nosuch"])
