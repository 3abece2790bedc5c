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


def hmma_loops(code):
    """[(start, end)] addresses of the innermost loops of ``code`` that hold HMMAs (a loop: a
    backward branch and its target; innermost: no other such loop inside it), in order."""
    hmma = [a for a, text in code if text.startswith("HMMA")]
    loops = set()
    for address, text in code:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= address:
            start = int(m.group(1), 16)
            if any(start <= a <= address for a in hmma):
                loops.add((start, address))
    return sorted(span for span in loops
                  if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o in loops))


def loop_figures(code, span):
    """The figures of the loop ``span`` of ``code``: its instructions, HMMAs, instructions per
    HMMA, median instructions between two HMMAs, 64-bit integer multiply-adds."""
    body = [text for a, text in code if span[0] <= a <= span[1]]
    hmma_at = [i for i, text in enumerate(body) if text.startswith("HMMA")]
    gaps = [b - a - 1 for a, b in zip(hmma_at, hmma_at[1:])]
    return {"instructions": len(body), "hmma": len(hmma_at),
            "per_hmma": round(len(body) / len(hmma_at), 2),
            "median_between_hmma": statistics.median(gaps) if gaps else None,
            "imad_wide": sum(text.startswith("IMAD.WIDE") for text in body)}


def summary(sass, ptxas_log):
    """The figures of one kernel: registers, spill bytes, :func:`loop_figures` of each kv loop
    (:func:`hmma_loops`, in code order), and {store width in bits: count} of the global
    stores."""
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    spills = [int(x) for pair in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                            ptxas_log) for x in pair]
    code = instructions(sass)
    stores = {}
    for _, text in code:
        if text.startswith("STG"):
            width = _store_bits(text.split()[0])
            stores[width] = stores.get(width, 0) + 1
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": sum(spills),
            "loops": [loop_figures(code, span) for span in hmma_loops(code)],
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


def format_summary(name, s, loop_names=()):
    """One specialisation's summary as text (the .sass.txt file ``cuda-ptx`` writes);
    ``loop_names``: what each kv loop is, in code order."""
    stores = ", ".join(f"{n} x {bits}-bit" for bits, n in s["store_bits"].items())
    lines = [name,
             f"  registers              {s['registers']}",
             f"  spill bytes            {s['spill_bytes']}"]
    for i, loop in enumerate(s["loops"]):
        what = loop_names[i] if i < len(loop_names) else f"kv loop {i + 1}"
        lines += [f"  {what}",
                  f"    instructions           {loop['instructions']}, {loop['hmma']} HMMA",
                  f"    instructions per HMMA  {loop['per_hmma']}",
                  f"    between two HMMAs      {loop['median_between_hmma']} (median)",
                  f"    IMAD.WIDE              {loop['imad_wide']}"]
    lines.append(f"  global stores          {stores}")
    return "\n".join(lines) + "\n"


def families():
    """The CUDA kernels with PTX specialisations: (ptx_names, ptx of a spec, loop_names of a
    spec) of the tensor-core prefill kernel and of the split-kv decode kernel."""
    from . import decode_kernel, tc_kernel
    return ((tc_kernel.ptx_names, lambda spec: tc_kernel.tc_ptx(*spec),
             lambda spec: tc_kernel.loop_names(spec[3])),
            (decode_kernel.ptx_names, lambda spec: decode_kernel.decode_ptx(*spec),
             lambda spec: decode_kernel.loop_names(*spec[3:])))


def write_ptx(out_dir, name_filter=""):
    """Write the PTX of every specialisation of every kernel (:func:`families`) whose file
    name contains ``name_filter`` into ``out_dir`` and, where the tools' wheels are installed,
    its SASS summary beside it (``tc_f16_d128_sm90.sass.txt``); returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    with_sass = not missing_tools()
    paths = []
    for names, ptx_of, loops_of in families():
        for name, spec in names().items():
            if name_filter not in name:
                continue
            path = os.path.join(out_dir, name)
            ptx = ptx_of(spec)
            with open(path, "w") as f:
                f.write(ptx)
            paths.append(path)
            if with_sass:
                path = os.path.join(out_dir, name[:-len(".ptx")] + ".sass.txt")
                with open(path, "w") as f:
                    f.write(format_summary(name, of_ptx(ptx, spec[2]), loops_of(spec)))
                paths.append(path)
    return paths
