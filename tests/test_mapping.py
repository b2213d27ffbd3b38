"""Table 3 of DNNFusion, transcribed from the paper independently of kiln.mapping."""
import itertools

import pytest

from kiln.mapping import MappingType as M, Verdict, fuse_types

O2O, O2M, M2M, REO, SHU = M.ONE_TO_ONE, M.ONE_TO_MANY, M.MANY_TO_MANY, M.REORGANIZE, M.SHUFFLE

# Rows: first op; columns in the paper's order: One-to-One, One-to-Many, Many-to-Many, Reorganize, Shuffle.
COLUMNS = [O2O, O2M, M2M, REO, SHU]
PAPER_RESULT_CELLS = {
    O2O: [O2O, O2M, M2M, REO, SHU],
    O2M: [O2M, O2M, None, O2M, O2M],
    M2M: [M2M, M2M, None, M2M, M2M],
    REO: [REO, O2M, M2M, REO, REO],
    SHU: [SHU, O2M, M2M, REO, SHU],
}


@pytest.mark.parametrize("first,second", itertools.product(COLUMNS, COLUMNS))
def test_result_cells_match_table_3(first, second):
    expected = PAPER_RESULT_CELLS[first][COLUMNS.index(second)]
    mapping, verdict = fuse_types(first, second)
    if expected is None:  # the paper's "X" cells
        assert verdict is Verdict.RED
    else:
        assert mapping == expected


def test_one_to_one_fuses_with_anything_in_either_order():
    for other in COLUMNS:
        assert fuse_types(O2O, other)[1] is Verdict.GREEN
        assert fuse_types(other, O2O)[1] is Verdict.GREEN


def test_red_cells_are_the_papers_unprofitable_pairs():
    red = {(a, b) for a, b in itertools.product(COLUMNS, COLUMNS) if fuse_types(a, b)[1] is Verdict.RED}
    assert red == {(O2M, M2M), (M2M, M2M)}


def test_reorganize_and_shuffle_with_heavy_types_need_profiling():
    for light in (REO, SHU):
        for heavy in (O2M, M2M):
            assert fuse_types(light, heavy)[1] is Verdict.YELLOW
            assert fuse_types(heavy, light)[1] is Verdict.YELLOW
    assert fuse_types(M2M, O2M)[1] is Verdict.YELLOW


def test_order_of_complexity_is_the_papers():
    assert sorted(COLUMNS) == [O2O, REO, SHU, O2M, M2M]
    assert max(REO, O2M) == O2M
