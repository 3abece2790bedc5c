"""The machine code of a kernel's PTX, summarised without a GPU: registers and spills from
``ptxas -v``, and from ``cuobjdump -sass`` the instruction mix of the kv loop.

The tools come from pinned wheels of the test extra: ptxas from ``nvidia-cuda-nvcc-cu12`` (the
NVVM that writes the PTX is the same release), cuobjdump and the nvdisasm it runs from
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``. :func:`summary` reads the SASS: the kv
loop is the innermost backward branch whose body holds every HMMA; its static instructions per
HMMA, the median run of instructions between two consecutive HMMAs there, its 64-bit integer
multiply-adds (``IMAD.WIDE``), and the widths of the kernel's global stores (``STG``).
"""
import os
import re
import statistics
import subprocess
import tempfile
from importlib import metadata

#: the wheels the tools come from, and the file each ships
TOOLS = {"ptxas": ("nvidia-cuda-nvcc-cu12", "bin/ptxas"),
         "cuobjdump": ("nvidia-cuda-cuobjdump", "bin/cuobjdump"),
         "nvdisasm": ("nvidia-cuda-nvdisasm", "bin/nvdisasm")}

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)")


def tool(name):
    """The path of tool ``name`` in its wheel (TOOLS), or None where it is not installed."""
    wheel, suffix = TOOLS[name]
    try:
        dist = metadata.distribution(wheel)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith(suffix):
            path = str(dist.locate_file(f))
            return path if os.access(path, os.X_OK) else None
    return None


def missing_tools():
    """The names of the tools whose wheels are not installed."""
    return [name for name in TOOLS if tool(name) is None]


def assemble(ptx, cc, cubin):
    """``ptxas -v`` of ``ptx`` for compute capability ``cc`` into the file ``cubin``: its log.
    Raises RuntimeError where ptxas fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([tool("ptxas"), f"-arch=sm_{cc[0]}{cc[1]}", "-v", "-o", cubin,
                              f.name], capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    log = res.stdout + res.stderr
    if res.returncode:
        raise RuntimeError(f"ptxas failed:\n{log}")
    return log


def disassemble(cubin):
    """``cuobjdump -sass`` of ``cubin`` (with the wheel's nvdisasm)."""
    env = dict(os.environ, NVDISASM_PATH=os.path.dirname(tool("nvdisasm")),
               PATH=os.pathsep.join([os.path.dirname(tool("nvdisasm")),
                                     os.environ.get("PATH", "")]))
    res = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                         timeout=600, env=env)
    if res.returncode:
        raise RuntimeError(f"cuobjdump failed:\n{res.stdout}{res.stderr}")
    return res.stdout


def instructions(sass):
    """[(address, instruction text without its predicate)] of a SASS listing."""
    found = []
    for m in _LINE.finditer(sass):
        text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2))
        found.append((int(m.group(1), 16), text))
    return found


def kv_loop(code):
    """(start, end) addresses of the innermost loop that holds every HMMA of ``code``, or
    None where there is no such loop."""
    hmma = [a for a, text in code if text.startswith("HMMA")]
    if not hmma:
        return None
    loops = []
    for address, text in code:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= hmma[0] and address >= hmma[-1]:
            loops.append((int(m.group(1), 16), address))
    return min(loops, key=lambda span: span[1] - span[0]) if loops else None


def summary(sass, ptxas_log):
    """The figures of one kernel: registers, spill bytes, and (see the module docstring) the
    kv loop's instructions per HMMA, median instructions between two HMMAs, IMAD.WIDE count,
    and {store width in bits: count} of the global stores."""
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    spills = [int(x) for pair in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                            ptxas_log) for x in pair]
    code = instructions(sass)
    loop = kv_loop(code)
    body = [text for a, text in code if loop and loop[0] <= a <= loop[1]]
    hmma_at = [i for i, text in enumerate(body) if text.startswith("HMMA")]
    gaps = [b - a - 1 for a, b in zip(hmma_at, hmma_at[1:])]
    stores = {}
    for _, text in code:
        if text.startswith("STG"):
            width = _store_bits(text.split()[0])
            stores[width] = stores.get(width, 0) + 1
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": sum(spills),
            "loop_instructions": len(body),
            "loop_hmma": len(hmma_at),
            "instructions_per_hmma": round(len(body) / len(hmma_at), 2) if hmma_at else None,
            "median_between_hmma": statistics.median(gaps) if gaps else None,
            "loop_imad_wide": sum(text.startswith("IMAD.WIDE") for text in body),
            "store_bits": dict(sorted(stores.items()))}


def _store_bits(opcode):
    """The width in bits of a global store opcode (STG.E.U16 16, STG.E 32, STG.E.128 128)."""
    for part in opcode.split(".")[1:]:
        digits = part.lstrip("SU")
        if digits.isdigit():
            return int(digits)
    return 32


def of_ptx(ptx, cc):
    """:func:`summary` of PTX ``ptx`` assembled for compute capability ``cc``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        log = assemble(ptx, cc, cubin)
        return summary(disassemble(cubin), log)


def format_summary(name, s):
    """One specialisation's summary as text (the .sass.txt file ``cuda-ptx`` writes)."""
    stores = ", ".join(f"{n} x {bits}-bit" for bits, n in s["store_bits"].items())
    return (f"{name}\n"
            f"  registers              {s['registers']}\n"
            f"  spill bytes            {s['spill_bytes']}\n"
            f"  kv loop                {s['loop_instructions']} instructions, "
            f"{s['loop_hmma']} HMMA\n"
            f"  instructions per HMMA  {s['instructions_per_hmma']}\n"
            f"  between two HMMAs      {s['median_between_hmma']} (median)\n"
            f"  IMAD.WIDE in the loop  {s['loop_imad_wide']}\n"
            f"  global stores          {stores}\n")
