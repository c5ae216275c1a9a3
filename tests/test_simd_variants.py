"""``simd``'s kernel variants (issue 25): avx512, avx2 and neon from one kernel body.

- the variant is chosen from the CPU's features, ``$BLOCKDIAG_SIMD_ISA`` forces another the CPU
  supports (one it does not is refused with the reason), each variant gets its own flags and
  its own cached file (stand-in compiler, any Linux x86-64 machine);
- the AVX2 variant forced, natively, passes the self-checks and a tail sweep (the whole simd
  test family runs with it on a CPU without AVX-512, and with ``BLOCKDIAG_SIMD_ISA=avx2`` on
  one with it);
- the aarch64 NEON variant, cross-compiled with ``aarch64-linux-gnu-gcc`` and run under
  ``qemu-aarch64`` by tests/native/simd_harness.c against a naive reference (block sides
  1..70, both dtypes, every kernel); skipped when the cross compiler or qemu is missing;
- builds with ``CC=clang`` and with a compiler that has no OpenMP (the serial kernels);
- the chooser never ranks simd from another variant's measurements.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from blockdiag import BlockDiagError, grouped_linear, profile
from blockdiag.backends import Problem, get, simd
from blockdiag.dispatch import choose
from blockdiag.testing import reference_loop

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "native" / "simd_harness.c"
KERNELS = ROOT / "blockdiag" / "backends"
X86_LINUX = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
CPU_FLAGS = set(simd._cpu_description().split("|")[-1].split())
HAS_AVX2 = X86_LINUX and {"avx2", "fma"} <= CPU_FLAGS
CC = shutil.which("cc") or shutil.which("gcc")
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}

needs_avx2 = pytest.mark.skipif(
    not HAS_AVX2 or CC is None, reason="needs Linux x86-64 with AVX2 and FMA and a C compiler")


@pytest.fixture
def library(monkeypatch, tmp_path):
    """simd's library looked up afresh (cleared caches, no variant forced); restored afterwards."""
    monkeypatch.delenv(simd.ISA_ENV, raising=False)
    simd._library.cache_clear()
    simd._check.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    simd._library.cache_clear()
    simd._check.cache_clear()
    profile.clear_cache()


def _sweep(dtype: torch.dtype) -> None:
    """Forward and every gradient against the loop reference on tails of every width."""
    gen = torch.Generator().manual_seed(25)
    for n, g, i, o in ((7, 3, 7, 17), (9, 2, 16, 16), (13, 2, 150, 10), (5, 4, 10, 150), (300, 2, 65, 7),
                       (11, 3, 40, 5), (3, 2, 9, 3), (17, 6, 3, 33), (20, 2, 25, 2)):
        x = torch.randn(n, g * i, dtype=dtype, generator=gen, requires_grad=True)
        w = torch.randn(g, o, i, dtype=dtype, generator=gen, requires_grad=True)
        b = torch.randn(g * o, dtype=dtype, generator=gen, requires_grad=True)
        gy = torch.randn(n, g * o, dtype=dtype, generator=gen)
        got = grouped_linear(x, w, b, backend="simd")
        want = reference_loop(x, w, b)
        for a, c in zip((got, *torch.autograd.grad(got, (x, w, b), gy)),
                        (want, *torch.autograd.grad(want, (x, w, b), gy))):
            torch.testing.assert_close(a, c, **TOL[dtype])


# --- choosing the variant ------------------------------------------------------------------

@pytest.mark.skipif(not X86_LINUX, reason="x86-64 variant choice")
@pytest.mark.parametrize(
    "flags,forced,want",
    [("avx512f avx2 fma", None, "avx512"), ("avx512f avx2 fma", "avx2", "avx2"), ("avx2 fma", None, "avx2"),
     ("avx2 fma", "AVX2", "avx2"), ("avx2 fma", "avx512", None), ("avx2", None, None), ("avx2 fma", "neon", None),
     ("avx2 fma", "mmx", None)],
)
def test_the_variant_follows_the_cpu_and_the_environment(monkeypatch, flags, forced, want):
    if forced is None:
        monkeypatch.delenv(simd.ISA_ENV, raising=False)
    else:
        monkeypatch.setenv(simd.ISA_ENV, forced)
    chosen, why = simd._choose_variant(f"Some CPU|fpu sse2 {flags}")
    assert chosen == want, why
    assert (why is None) == (want is not None)
    if forced in ("avx512", "neon"):
        assert f"BLOCKDIAG_SIMD_ISA={forced} asks for the {forced} kernels, which this CPU cannot run" in why


def test_aarch64_always_has_neon(monkeypatch):
    monkeypatch.setattr(simd.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv(simd.ISA_ENV, raising=False)
    assert simd._choose_variant("0x41 0xd0c|fp asimd evtstrm") == ("neon", None)
    monkeypatch.setenv(simd.ISA_ENV, "avx2")
    chosen, why = simd._choose_variant("0x41 0xd0c|fp asimd")
    assert chosen is None and "cannot run" in why and "it can run: neon" in why


@pytest.mark.skipif(CC is None or not X86_LINUX, reason="needs a C compiler on Linux x86-64")
def test_each_variant_has_its_flags_and_its_own_cached_file(library, monkeypatch):
    """A stand-in compiler records its arguments: the variants' flags differ and their files coexist."""
    tmp = library
    log = tmp / "args.log"
    src = tmp / "stub.c"
    text = f"int bd_abi_version(void) {{ return {simd._ABI}; }}\n"
    for base in simd._SIGNATURES:
        for sfx in simd._SUFFIX.values():
            text += f"int {base}_{sfx}(void) {{ return -999; }}\n"
    src.write_text(text)
    cc = tmp / "stubcc"
    cc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then echo "stubcc 1.0"; exit 0; fi
        echo "$*" >> {log}
        out=""
        while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; shift; fi; shift; done
        exec {CC} -shared -fPIC -O0 -o "$out" -x c {src}
        """))
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
    monkeypatch.setattr(simd, "_cpu_description", lambda: "Stub CPU|avx512f avx2 fma")
    for forced, want in ((None, "avx512"), ("avx2", "avx2")):
        if forced:
            monkeypatch.setenv(simd.ISA_ENV, forced)
        simd._library.cache_clear()
        assert simd._library()[1] is None
        assert simd.variant() == want
        assert want in simd.variant_note() and ("forced by BLOCKDIAG_SIMD_ISA" in simd.variant_note()) == bool(forced)
    args = log.read_text().splitlines()
    assert len(args) == 2 and all("-fopenmp" in a for a in args)
    assert "-DBD_ISA_AVX512" in args[0] and "-march=native" in args[0] and "-mavx2" not in args[0]
    assert all(f in args[1].split() for f in ("-DBD_ISA_AVX2", "-mavx2", "-mfma", "-mno-avx512f"))
    files = sorted(p.name for p in (tmp / "cache" / "blockdiag" / "kernels").iterdir() if p.suffix == ".so")
    assert [f.split("-")[1] for f in files] == ["avx2", "avx512"], files
    # aarch64: the neon flags
    monkeypatch.setattr(simd.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv(simd.ISA_ENV)
    simd._library.cache_clear()
    assert simd._library()[1] is None and simd.variant() == "neon"
    assert "-DBD_ISA_NEON" in log.read_text().splitlines()[-1] and "-march=armv8-a" in log.read_text()


# --- the AVX2 variant, natively --------------------------------------------------------------

@needs_avx2
def test_avx2_forced_runs_the_avx2_kernels(library, monkeypatch):
    monkeypatch.setenv(simd.ISA_ENV, "avx2")
    assert get("simd").unavailable_reason() is None
    assert simd.variant() == "avx2"
    assert "simd kernels: avx2 (AVX2 and FMA" in simd.variant_note()
    for dtype in (torch.float32, torch.float64):
        assert simd.self_check(dtype) is None
        _sweep(dtype)


@pytest.mark.skipif(not X86_LINUX or "avx512f" in CPU_FLAGS, reason="needs an x86-64 CPU without AVX-512")
def test_avx512_forced_on_a_cpu_without_it_is_unavailable_with_the_reason(library, monkeypatch):
    monkeypatch.setenv(simd.ISA_ENV, "avx512")
    why = get("simd").unavailable_reason()
    assert why is not None and "BLOCKDIAG_SIMD_ISA=avx512 asks for the avx512 kernels" in why and "no AVX-512F" in why
    assert simd.variant() is None and "unavailable" in simd.variant_note()
    with pytest.raises(BlockDiagError, match="simd.*BLOCKDIAG_SIMD_ISA=avx512 asks"):
        grouped_linear(torch.randn(2, 4), torch.randn(2, 2, 2), None, backend="simd")
    plan = choose(Problem(64, 16, 10, 10))
    assert plan.backend != "simd"


def test_explain_says_which_variant_runs(capsys):
    from blockdiag.cli import main

    assert main(["explain", "--batch", "8", "--groups", "4", "--block", "10x10"]) == 0
    out = capsys.readouterr().out
    v = simd.variant()
    assert (f"simd kernels: {v} (" if v else "simd kernels: unavailable: ") in out


# --- building: clang, and no OpenMP -----------------------------------------------------------

def _wrapper(folder: Path, body: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "cc"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


@needs_avx2
def test_a_compiler_without_openmp_builds_the_serial_kernels(library, monkeypatch):
    # A driver that refuses -fopenmp the way clang without libomp does, else is the system's cc.
    cc = _wrapper(library / "bin", textwrap.dedent(f"""\
        for a in "$@"; do
          if [ "$a" = "-fopenmp" ]; then echo "fatal error: 'omp.h' file not found" >&2; exit 1; fi
        done
        exec {CC} "$@" -O0
        """))  # -O0: see _builds.py
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("XDG_CACHE_HOME", str(library / "cache"))
    assert get("simd").unavailable_reason() is None
    assert "serial: the compiler has no OpenMP" in simd.variant_note()
    torch.set_num_threads(torch.get_num_threads())  # the serial kernels ignore the thread count
    for dtype in (torch.float32, torch.float64):
        assert simd.self_check(dtype) is None
        _sweep(dtype)


@needs_avx2
@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed (apt-get install clang)")
def test_clang_builds_the_kernels(library, monkeypatch):
    monkeypatch.setenv("CC", "clang")
    monkeypatch.setenv("XDG_CACHE_HOME", str(library / "cache"))
    why = get("simd").unavailable_reason()
    assert why is None, why
    assert simd.variant() in ("avx512", "avx2")
    for dtype in (torch.float32, torch.float64):
        assert simd.self_check(dtype) is None
        _sweep(dtype)


# --- the NEON variant under qemu ---------------------------------------------------------------

AARCH64_CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


def _harness_build(cc: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([cc, "-O2", "-static", *flags, "-I", str(KERNELS), "-o", str(out), str(HARNESS), "-lm"],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(AARCH64_CC is None or QEMU is None,
                    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
def test_neon_variant_matches_the_reference_under_qemu(tmp_path):
    exe = tmp_path / "harness-neon"
    done = _harness_build(AARCH64_CC, exe, "-march=armv8-a", "-DBD_ISA_NEON", "-fopenmp")
    if done.returncode != 0:  # a cross toolchain without libgomp: the serial kernels
        done = _harness_build(AARCH64_CC, exe, "-march=armv8-a", "-DBD_ISA_NEON")
    assert done.returncode == 0, done.stderr[-2000:]
    run = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1].startswith("ok"), run.stdout[-3000:] + run.stderr[-2000:]
    assert "neon float32: " in run.stdout and "neon float64: " in run.stdout


@pytest.mark.skipif(not HAS_AVX2 or CC is None, reason="needs Linux x86-64 with AVX2 and FMA and a C compiler")
def test_the_harness_runs_the_avx2_variant_natively(tmp_path):
    exe = tmp_path / "harness-avx2"
    done = _harness_build(CC, exe, "-march=native", "-mno-avx512f", "-mavx2", "-mfma", "-DBD_ISA_AVX2", "-fopenmp")
    assert done.returncode == 0, done.stderr[-2000:]
    run = subprocess.run([str(exe), "40"], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "avx2 float64: " in run.stdout, run.stdout[-3000:]


# --- the chooser and the variant ---------------------------------------------------------------

def _entry(variant):
    e = {"device": "cpu", "device_name": "Some CPU (2 threads)", "torch": torch.__version__, "dtype": "float32",
         "measurements": [{"mode": "forward", "batch": 64, "groups": 16, "block_in": 10, "block_out": 10,
                           "times_us": {"simd": 5.0, "bmm_fm": 50.0, "loop": 100.0}}]}
    if variant:
        e["simd_variant"] = variant
    return e


def test_simd_times_of_another_variant_are_dropped(monkeypatch):
    monkeypatch.setattr(profile, "_running_simd_variant", lambda device: "avx2")
    fitted = profile.fit_variant(_entry("avx512"), "cpu")
    assert "simd" not in fitted["measurements"][0]["times_us"] and "bmm_fm" in fitted["measurements"][0]["times_us"]
    assert "avx512 kernels, this machine runs avx2" in fitted["not_measured"]["simd"]
    for same in (_entry("avx2"), _entry(None)):
        assert profile.fit_variant(same, "cpu") is same


def test_the_builtin_table_prefers_the_running_variant(monkeypatch):
    doc = {"format": profile.FORMAT, "version": profile.VERSION, "defaults": {"cpu": "d"},
           "entries": {"d": {**_entry("avx512"), "device_name": "Default CPU"},
                       "n512": _entry("avx512"), "n2": {**_entry("avx2")}}}
    monkeypatch.setattr(profile, "read_profile", lambda path: (doc, None))
    monkeypatch.setattr(profile, "device_name", lambda device: "Some CPU (2 threads)")
    monkeypatch.setattr(profile, "_running_simd_variant", lambda device: "avx2")
    assert profile.builtin_entry("cpu", torch.float32) is doc["entries"]["n2"]
    monkeypatch.setattr(profile, "_running_simd_variant", lambda device: "avx512")
    assert profile.builtin_entry("cpu", torch.float32) is doc["entries"]["n512"]
    # another machine: the default if its variant runs here, else an entry of the running variant
    monkeypatch.setattr(profile, "device_name", lambda device: "Other CPU (2 threads)")
    assert profile.builtin_entry("cpu", torch.float32) is doc["entries"]["d"]
    monkeypatch.setattr(profile, "_running_simd_variant", lambda device: "avx2")
    assert profile.builtin_entry("cpu", torch.float32) is doc["entries"]["n2"]
    # only another variant's entries: used without simd's times
    del doc["entries"]["n2"]
    got = profile.builtin_entry("cpu", torch.float32)
    assert got["device_name"] == "Default CPU" and "simd" not in got["measurements"][0]["times_us"]


def test_the_shipped_cpu_entries_say_their_variant():
    doc, err = profile.read_profile(profile.DEFAULTS_PATH)
    assert err is None
    for key, e in doc["entries"].items():
        if e["device"] == "cpu":
            assert e.get("simd_variant") in simd.VARIANTS, key


@pytest.mark.skipif(get("simd").unavailable_reason() is not None, reason="simd unavailable here")
def test_auto_never_ranks_simd_from_another_variants_times():
    profile.clear_cache()
    entry = profile.builtin_entry("cpu", torch.float32)
    running = simd.variant()
    if entry.get("simd_variant") != running:
        assert all("simd" not in m["times_us"] for m in entry["measurements"])
    plan = choose(Problem(256, 50, 10, 10, requires_grad=True))
    cand = {c.name: c for c in plan.candidates}["simd"]
    if entry.get("simd_variant") != running:
        assert cand.estimate_us is None and f"this machine runs {running}" in cand.note
