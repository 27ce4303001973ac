"""The files libtpu dumps per LLO program, and the contents of the small ones.

Compiling a JAX program for TPU with ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR`` makes libtpu write,
per compiled HLO op, ``<fingerprint>-<op name>-<NN>-<stage>.txt`` files (`find_dump_files`;
`dump_flags` asks for the stages read here only).
Besides the scheduled program (``...-final_bundles.txt``: `evaluate.bundle_listing`)
and the compiler's critical path (``...-critical-path.txt``: `read.critical_path`),
these are read:

``...-final_hlo-static-per-bundle-utilization.txt``
    ``== CAPACTIY:`` (sic), a line of unit names, a line of slot capacities, ``== UTILIZATION:``
    and one row of used slots per bundle, in bundle order.

``...-schedule-analysis_final_bundles.txt``
    ``total scheduled bundles: N`` and the op's HLO instruction (for a Pallas kernel a
    ``custom-call`` with ``custom_call_target="tpu_custom_call"``).

``...-original.txt``
    The first LLO pass: the memory allocations, for the VMEM a kernel uses, and its grid.

``<fingerprint>-TLP-hlo.txt``
    The optimized HLO module of the program (`find_program_hlo`): the operands each kernel
    is called with.

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from pallas_flash_estimate.read import hlo_ops

__all__ = [
    "ScheduleAnalysis",
    "Utilization",
    "dump_flags",
    "find_dump_files",
    "find_program_hlo",
    "kernel_operands",
    "op_name",
    "parse_grid",
    "parse_schedule_analysis",
    "parse_utilization",
    "parse_vmem_bytes",
]

_FILE_RE = re.compile(r"^(?P<fp>\d+)-(?P<name>.+)-(?P<nn>\d+)-(?P<kind>[\w\-]+)\.txt$")

_KIND_BUNDLES = "final_bundles"
_KIND_UTIL = "final_hlo-static-per-bundle-utilization"
_KIND_ANALYSIS = "schedule-analysis_final_bundles"
_KIND_ORIGINAL = "original"  # the first LLO pass: lists the kernel's memory allocations
_KIND_CRITICAL_PATH = "critical-path"

_READ_PASSES = (_KIND_BUNDLES, _KIND_UTIL, _KIND_ANALYSIS, _KIND_ORIGINAL, _KIND_CRITICAL_PATH)

_WRAPPER_OPS = ("TLP",)

_CC_TARGET_RE = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_VMEM_ALLOCATION_RE = re.compile(r"#allocation\d+ \[.*?space=vmem, size = 0x([0-9a-f]+)")
_GRID_INDEX_RE = re.compile(
    r"%s\d+ = sphi 0, (?P<next>%s\d+) /\* iteration index, stage = 0 iter bound = (?P<dim>\d+) \*/"
)
_WRAP_SELECT_RE = re.compile(
    r"(?P<dst>%s\d+) = scalar_select /\*predicate=\*/(?P<pred>%p\d+), /\*on_true=\*/0, "
    r"/\*on_false=\*/%s\d+"
)
_BOUND_TEST_RE = re.compile(
    r"(?P<dst>%p\d+) = scmp\.ge\.s32\.totalorder %s\d+, (?P<bound>\d+|%s\d+)\n"
)
_SCALAR_OPERAND_RE = re.compile(
    r"(?P<reg>%s\d+) = inlined_call_operand\.<no memory space> \[shape: [su]32\[\], "
    r"index: (?P<index>\d+),"
)
_PROGRAM_HLO_RE = re.compile(r"^\d+-TLP-hlo\.txt$")


@dataclasses.dataclass(frozen=True)
class Utilization:
    units: tuple[str, ...]
    capacity: dict[str, int]
    rows: tuple[tuple[int, ...], ...]  # per bundle, slots used per unit (in ``units`` order)
    warnings: tuple[str, ...] = ()

    def summed(self, start: int = 0, end: int | None = None) -> dict[str, int]:
        """Slots used per unit over bundles ``start..end`` (inclusive)."""
        stop = len(self.rows) if end is None else end + 1
        sums = [0] * len(self.units)
        for row in self.rows[start:stop]:
            for k, v in enumerate(row):
                sums[k] += v
        return dict(zip(self.units, sums, strict=True))


def parse_utilization(text: str) -> Utilization:
    """Parse a ``final_hlo-static-per-bundle-utilization`` text."""
    lines = [ln.strip() for ln in text.splitlines()]
    warnings: list[str] = []
    try:
        cap_at = next(i for i, ln in enumerate(lines) if re.match(r"==\s*CAPAC\w*\s*:", ln))
        util_at = next(i for i, ln in enumerate(lines) if re.match(r"==\s*UTILIZATION\s*:", ln))
    except StopIteration:
        raise ValueError("not a per-bundle utilization file (no CAPACITY/UTILIZATION)") from None
    head = [ln for ln in lines[cap_at + 1 : util_at] if ln]
    if len(head) != 2:
        raise ValueError(f"expected unit names and capacities, got {len(head)} lines")
    units = tuple(u.strip() for u in head[0].split(",") if u.strip())
    caps = [int(x) for x in head[1].split()]
    if len(caps) != len(units):
        raise ValueError(f"{len(units)} units but {len(caps)} capacities")
    rows = []
    for i, ln in enumerate(lines[util_at + 1 :]):
        if not ln:
            continue
        vals = tuple(int(x) for x in ln.split())
        if len(vals) != len(units):
            warnings.append(f"utilization row {i} has {len(vals)} values, expected {len(units)}")
            vals = (vals + (0,) * len(units))[: len(units)]
        rows.append(vals)
    return Utilization(
        units=units,
        capacity=dict(zip(units, caps, strict=True)),
        rows=tuple(rows),
        warnings=tuple(warnings),
    )


@dataclasses.dataclass(frozen=True)
class ScheduleAnalysis:
    total: int | None  # total scheduled bundles
    empty: int | None  # empty scheduled bundles
    hlo: str | None  # the first HLO instruction attributed bundles

    @property
    def custom_call_target(self) -> str | None:
        m = _CC_TARGET_RE.search(self.hlo or "")
        return m["target"] if m else None


def parse_schedule_analysis(text: str) -> ScheduleAnalysis:
    def num(label: str) -> int | None:
        m = re.search(rf"^\s*{label}:\s*(\d+)", text, re.M)
        return int(m.group(1)) if m else None

    m = re.search(r"scheduled bundles \([^)]*\):\s*(%.*)", text)
    hlo = None
    if m:
        # The instruction may span lines (frontend attributes with embedded newlines); stop at
        # the per-opcode summary.
        rest = text[m.start(1) :]
        hlo = rest.split("\n\t[opcode]")[0].strip()
    return ScheduleAnalysis(
        total=num("total scheduled bundles"), empty=num("empty scheduled bundles"), hlo=hlo
    )


def parse_vmem_bytes(text: str) -> int:
    """Bytes of VMEM an LLO program allocates: the sum of its ``space=vmem`` allocations
    (scratch operands, the double-buffered block windows, internal scratch), as listed in the
    ``...-original.txt`` pass of the dump."""
    return sum(int(size, 16) for size in _VMEM_ALLOCATION_RE.findall(text))


def parse_grid(
    text: str, operands: Mapping[int, int | tuple[int, ...]] | None = None
) -> tuple[int, ...] | None:
    """A Pallas kernel's grid, read from the grid-index counters of its ``...-original.txt``
    pass, or None when they are not all found.

    Each grid index ``D`` is a loop phi ``%sA = sphi 0, %sN /* iteration index, stage = 0 iter
    bound = D */`` whose next value wraps to 0 at the dimension's size:
    ``%sN = scalar_select /*predicate=*/%pP, /*on_true=*/0, ...`` with
    ``%pP = scmp.ge.s32.totalorder %sI, SIZE``. Unlike the DMA descriptors' ``iteration_bounds``
    this does not need the kernel to copy anything (XLA may place small operands in VMEM, and
    the kernel then issues no DMA). A grid sized at run time compares with a scalar operand
    instead (``%sK = inlined_call_operand.<no memory space> [shape: s32[], index: I, ...]``):
    its size is ``operands[I]``, the value the kernel is called with (`hlo_ops` reads it from
    the program's HLO), and unknown without it.
    """
    scalars = {m["reg"]: int(m["index"]) for m in _SCALAR_OPERAND_RE.finditer(text)}
    known = {
        reg: value
        for reg, i in scalars.items()
        if isinstance(value := (operands or {}).get(i), int)
    }
    wraps = {m["dst"]: m["pred"] for m in _WRAP_SELECT_RE.finditer(text)}
    bounds = {
        m["dst"]: int(b) if b.isdigit() else known.get(b)
        for m in _BOUND_TEST_RE.finditer(text)
        for b in [m["bound"]]
    }
    sizes: dict[int, int] = {}
    for m in _GRID_INDEX_RE.finditer(text):
        size = bounds.get(wraps.get(m["next"], ""))
        if size is None:
            return None
        sizes[int(m["dim"])] = size
    if not sizes or sorted(sizes) != list(range(len(sizes))):
        return None
    return tuple(sizes[d] for d in range(len(sizes)))


def dump_flags(dump_dir: str | Path) -> str:
    """The ``LIBTPU_INIT_ARGS`` flags that make libtpu dump what this module reads to
    ``dump_dir``: the passes it reads only (``--xla_jf_dump_llo_pass_label_regex``), not the
    60-odd others, which for a large unrolled kernel (RPA v3's mixed kernel) are hundreds of
    MiB of text the compile spends its time writing."""
    passes = "|".join(_READ_PASSES)
    return f"--xla_jf_dump_to={dump_dir} --xla_jf_dump_llo_pass_label_regex=^({passes})$"


def find_program_hlo(dump_dir: str | Path) -> list[Path]:
    """The optimized HLO modules of the programs dumped into ``dump_dir``
    (``<fingerprint>-TLP-hlo.txt``), in name order."""
    return sorted(p for p in Path(dump_dir).iterdir() if _PROGRAM_HLO_RE.match(p.name))


def kernel_operands(dump_dir: str | Path) -> dict[str, dict[int, int | tuple[int, ...]]]:
    """Per kernel call of the programs dumped into ``dump_dir``, its integer constant operands
    (`hlo_ops.kernel_constant_operands` of each `find_program_hlo`); a kernel name the
    programs call with different values is left out (which run a listing belongs to is then
    unknown)."""
    found: dict[str, dict[int, int | tuple[int, ...]]] = {}
    clashes: set[str] = set()
    for path in find_program_hlo(dump_dir):
        for name, values in hlo_ops.kernel_constant_operands(path.read_text()).items():
            if found.setdefault(name, values) != values:
                clashes.add(name)
    return {name: values for name, values in found.items() if name not in clashes}


def op_name(path: Path) -> str:
    """The op name in a dump file's name (its stem when not named like a dump file)."""
    m = _FILE_RE.match(path.name)
    return m["name"] if m else path.stem


def find_dump_files(dump_dir: str | Path) -> dict[str, dict[str, Path]]:
    """Per op, keyed like `llo.load_dump`: its ``bundles``, ``utilization``, ``analysis``,
    ``allocations`` and ``critical_path`` paths (the companions when dumped).

    The wrapper programs (``<late-finalization>``, ``<late-initialization>``, ``TLP``) are left
    out. Raises :class:`FileNotFoundError` when the folder is missing or holds no final_bundles
    file at all (the dump flag did not reach libtpu).
    """
    d = Path(dump_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"LLO dump folder not found: {d}")
    kinds = {
        _KIND_BUNDLES: "bundles",
        _KIND_UTIL: "utilization",
        _KIND_ANALYSIS: "analysis",
        _KIND_ORIGINAL: "allocations",
        _KIND_CRITICAL_PATH: "critical_path",
    }
    found: dict[tuple[str, str], dict[str, tuple[int, Path]]] = {}
    any_bundles = False
    for p in sorted(d.iterdir()):
        m = _FILE_RE.match(p.name)
        if not m or m["kind"] not in kinds:
            continue
        any_bundles = any_bundles or m["kind"] == _KIND_BUNDLES
        name = m["name"]
        if name.startswith("<") or name in _WRAPPER_OPS:
            continue
        files = found.setdefault((m["fp"], name), {})
        kind, nn = kinds[m["kind"]], int(m["nn"])
        if kind not in files or files[kind][0] < nn:
            files[kind] = (nn, p)
    if not any_bundles:
        raise FileNotFoundError(f"no *-final_bundles.txt file in LLO dump folder {d}")
    out: dict[str, dict[str, Path]] = {}
    for (fp, name), files in sorted(found.items()):
        if "bundles" not in files:
            continue
        key = name if name not in out else f"{name}@{fp}"
        out[key] = {kind: path for kind, (_nn, path) in files.items()}
    return out
