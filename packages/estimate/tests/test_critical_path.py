"""The compiler's critical path per basic block, on trimmed real dumps of the pallas forward
(4096 x 1024 blocks) and of splash attention (1024 / 1024 blocks) at N=4096: their bundles cut
down to the control flow, the scalar code and some MXU bundles, their critical-path files to
each block's header and longest line."""

from __future__ import annotations

from pathlib import Path

from pallas_flash_estimate.cost import llo
from pallas_flash_estimate.read import critical_path, dump_files

SAMPLES = Path(__file__).parent / "samples" / "llo"
PALLAS = SAMPLES / "pallas_forward_4096"
SPLASH = SAMPLES / "splash_forward_4096"
PALLAS_CP = PALLAS / "1795453299117862486-pallas_flash_forward.1-35-critical-path.txt"


def _only(folder: Path) -> llo.KernelSchedule:
    (schedule,) = llo.load_dump(folder).values()
    return schedule


def test_blocks_in_file_order_with_their_longest_path() -> None:
    blocks = critical_path.parse_critical_path(PALLAS_CP.read_text())
    assert [(b.region, b.length) for b in blocks] == [
        (108, 1),
        (113, 17),
        (31, 2),
        (31, 2),
        (47, 16882),  # the step's compute: 16,384 cycles of matmuls on one MXU, pushes overlapped
        (51, 16916),
        (55, 21),
        (31, 4),
        (113, 4),
        (3, 1),
    ]
    assert (blocks[4].members, blocks[4].parent) == (54016, 31)


def test_region_spans_from_the_bundle_comments() -> None:
    listing = _only(PALLAS).listing
    spans = critical_path.region_spans([b.comment for b in listing.bundles])
    assert spans[113] == (11, 171)  # the grid loop's body
    assert spans[31] == (11, 165)  # the pipeline guard: the step's compute
    assert spans[47] == (74, 104) and spans[51] == (112, 143)
    assert spans[48] == (105, 105)  # "Start/End empty region 48"


def test_each_region_is_charged_to_its_last_own_bundle() -> None:
    listing = _only(SPLASH).listing
    schedule = _only(SPLASH)
    weights, warnings = critical_path.bundle_weights(
        schedule.critical_path, [b.comment for b in listing.bundles]
    )
    assert warnings == []
    charged = {i: w for i, w in enumerate(weights) if w}
    # region 0 (the entry, no comment) at bundle 0; region 31's three blocks (22 + 9 + 6) after
    # its last nested region; region 35 (the accumulator init) at its end, inside the predicated
    # region that skips it, though its first bundles were hoisted above the branch
    assert charged == {0: 4, 12: 1, 63: 1, 333: 4292, 340: 22, 367: 37, 374: 23, 383: 1}
    assert sum(weights) == sum(b.length for b in schedule.critical_path)
    regions = {(r.start, r.end): r.executed_iterations for r in schedule.grid_loop.regions}
    assert regions[(63, 63)] == 64  # the init runs on the first kv step of each of 64 rows


def test_a_region_missing_from_the_bundles_is_counted_once_with_a_warning() -> None:
    blocks = (critical_path.Block(region=77, parent=1, members=3, length=9),)
    weights, warnings = critical_path.bundle_weights(blocks, ["", "/* Start region 1 */"])
    assert weights == [9, 0]
    assert warnings == ["critical path of region 77 (9 cycles) has no bundles: counted once"]


def test_load_dump_reads_the_critical_path_beside_the_bundles() -> None:
    files = dump_files.find_dump_files(PALLAS)
    assert sorted(files["pallas_flash_forward.1"]) == ["bundles", "critical_path", "utilization"]
    schedule = _only(PALLAS)
    assert len(schedule.critical_path) == 10 and schedule.warnings == ()
