"""wxh64, the CPU checksum of weight sync: the native kernel (copy + hash in one pass, hash
alone, chunked across threads) against the independent numpy reference, and what it must catch.

Reference: `weight_sync.checksum.wxh64_reference`, the spec in numpy (no native code)."""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import native_build
from weight_sync import BucketPacker, native, unpack
from weight_sync.checksum import checksum, copy_with_checksums, wxh64_reference

pytestmark = pytest.mark.skipif(
    native.kernel() is None, reason="no C compiler: wxh64 falls back to xxh3"
)

LENGTHS = [0, 1, 3, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4097, 65_537]


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.mark.parametrize("n", LENGTHS)
def test_native_matches_reference_on_odd_lengths_and_alignments(n):
    lib = native.kernel()
    pool = _bytes(n + 64, seed=n)
    out = np.zeros(n + 64, dtype=np.uint8)
    for src_off in (0, 1, 3, 4, 8, 13, 32):
        src = pool[src_off : src_off + n]
        expected = wxh64_reference(src.tobytes())
        assert checksum(torch.from_numpy(src.copy()), "wxh64") == expected
        assert (
            checksum(torch.from_numpy(pool)[src_off : src_off + n], "wxh64") == expected
        )  # unaligned view
        for dst_off in (0, 4, 5, 8, 24):
            for streaming in (0, 1):
                dst = out[dst_off : dst_off + n]
                dst[:] = 0
                v = lib.wxh64_copy_sum(src.ctypes.data, dst.ctypes.data, n, 0, streaming)
                assert np.array_equal(dst, src), (src_off, dst_off, streaming)
                assert _finalize(v, n) == expected, (src_off, dst_off, streaming)


# Each vector loop of wxh64.c, built alone: on this CPU (-march=native) the kernel runs one of
# them, so the others are checked here. Empty flags: the widest the CPU has.
VECTOR_PATHS = {
    "native": [],
    "avx2": ["-mno-avx512f"],
    "scalar": ["-mno-avx512f", "-mno-avx2"],
}


@pytest.mark.parametrize("path", sorted(VECTOR_PATHS))
def test_every_vector_path_matches_reference(path, tmp_path):
    """The AVX-512, AVX2 and scalar loops compute the same function (exactly: integer sums), on
    lengths around their step sizes (128, 64, 32 bytes), unaligned, copying with ordinary and
    streaming stores, and at a nonzero starting word (a piece of a split job)."""
    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    library = tmp_path / f"wxh64_{path}.so"
    subprocess.run(
        [cc, *native.FLAGS, *VECTOR_PATHS[path], "-o", str(library), str(native.SOURCE)],
        check=True,
    )
    lib = native._declare(ctypes.CDLL(str(library)))
    for n in [*LENGTHS, 255, 256, 257, 1 << 16]:
        pool = _bytes(n + 72, seed=n + 1)
        for src_off, dst_off, word0 in ((0, 0, 0), (3, 5, 0), (8, 24, 0), (0, 8, 1000)):
            src = pool[src_off : src_off + n]
            expected = _finalize(lib.wxh64_sum(src.ctypes.data, n, 0), n)
            assert expected == wxh64_reference(src.tobytes()), (path, n, src_off)
            # a piece starting at word `word0`: its partial sum plus the words before it
            if word0 and n:
                whole = np.concatenate([_bytes(8 * word0, seed=7), src])
                total = lib.wxh64_sum(whole.ctypes.data, 8 * word0, 0) + lib.wxh64_sum(
                    src.ctypes.data, n, word0
                )
                assert _finalize(total & ((1 << 64) - 1), whole.size) == wxh64_reference(
                    whole.tobytes()
                ), (path, n)
            for streaming in (0, 1):
                out = np.zeros(n + 72, dtype=np.uint8)
                dst = out[dst_off : dst_off + n]
                v = lib.wxh64_copy_sum(src.ctypes.data, dst.ctypes.data, n, 0, streaming)
                assert np.array_equal(dst, src), (path, n, dst_off, streaming)
                assert not out[:dst_off].any() and not out[dst_off + n :].any(), (path, n)
                assert _finalize(v, n) == expected, (path, n, dst_off, streaming)


def _finalize(v: int, n: int) -> int:
    from weight_sync.checksum import _finalize as finalize

    return finalize(v, n)


@pytest.mark.parametrize("n", [(9 << 20) + 12_345, (33 << 20) + 3])
def test_chunked_across_threads_matches_reference(n):
    """Below `_INLINE_BYTES` (9 MiB) one call per tensor, above it (33 MiB) chunks that threads
    claim; the sum must not depend on it."""
    data = torch.from_numpy(_bytes(n, seed=1))
    expected = wxh64_reference(data.numpy())
    assert checksum(data, "wxh64") == expected
    dst = torch.empty_like(data)
    assert copy_with_checksums([(dst, data)], "wxh64") == [expected]
    assert torch.equal(dst, data)
    lib = native.kernel()  # any split at a whole word adds up to the same sum
    cut = (n // 3) // 8 * 8
    v = lib.wxh64_sum(data.data_ptr(), cut, 0) + lib.wxh64_sum(
        data.data_ptr() + cut, n - cut, cut // 8
    )
    assert _finalize(v & ((1 << 64) - 1), n) == expected


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]
)
def test_checksum_of_tensors_matches_reference(dtype):
    t = (torch.randn(3, 1001) * 100).to(dtype)
    assert checksum(t, "wxh64") == wxh64_reference(t.contiguous().view(torch.uint8).numpy())
    assert checksum(t.t(), "wxh64") == wxh64_reference(t.t().contiguous().view(torch.uint8).numpy())


def test_every_single_flipped_bit_is_caught():
    """Each word's contribution is a bijection of it, so any change inside one word is caught:
    checked for every bit of a 45-byte buffer (a zero-padded tail word included), natively and in
    the reference, and for bits spread over a chunked 9 MiB tensor."""
    small = _bytes(45, seed=2)
    reference = wxh64_reference(small.tobytes())
    for bit in range(45 * 8):
        flipped = small.copy()
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert wxh64_reference(flipped.tobytes()) != reference, bit
        assert checksum(torch.from_numpy(flipped), "wxh64") != reference, bit
    big = torch.from_numpy(_bytes((9 << 20) + 5, seed=3))
    reference = checksum(big, "wxh64")
    rng = np.random.default_rng(4)
    n = big.numel()
    positions = [0, n - 1, 4 << 20, (4 << 20) - 1, *rng.integers(0, n, size=64)]
    for pos in positions:
        for bit in (0, 7, int(rng.integers(0, 8))):
            flipped = big.clone()
            flipped[int(pos)] ^= 1 << bit
            assert checksum(flipped, "wxh64") != reference, (pos, bit)


def test_swapped_shifted_and_resized_buffers_change_it():
    x = torch.randn(4096)
    reference = checksum(x, "wxh64")
    swapped_words = x.clone()
    swapped_words.view(torch.int64)[[10, 900]] = swapped_words.view(torch.int64)[[900, 10]]
    swapped_floats = x.clone()
    swapped_floats[[0, 1]] = swapped_floats[[1, 0]]  # inside one 64-bit word
    assert checksum(swapped_words, "wxh64") != reference
    assert checksum(swapped_floats, "wxh64") != reference
    assert checksum(torch.roll(x, 2), "wxh64") != reference  # shifted by one word
    zeros = torch.zeros(16, dtype=torch.uint8)
    assert checksum(zeros, "wxh64") != checksum(zeros[:15], "wxh64")  # the length counts


def test_packer_uses_wxh64_and_round_trips_bitwise():
    tensors = [
        ("a", torch.randn(1000)),
        ("b", torch.randn(7, 13)),
        ("c", torch.randn(3, 5).t()),  # non-contiguous
        ("d", torch.randn(9).to(torch.bfloat16)),
        ("e", torch.randn(5 << 20)),
    ]
    for verify in (True, False):
        seen = {}
        for buffer, manifest in BucketPacker(bucket_bytes=64 << 10, verify=verify).pack(tensors):
            assert manifest.checksum_algorithm == ("wxh64" if verify else "none")
            for entry, (name, view) in zip(manifest.entries, unpack(buffer, manifest)):
                seen[name] = view.clone()
                if verify:
                    assert entry.checksum == wxh64_reference(
                        view.contiguous().view(torch.uint8).numpy()
                    )
        for name, tensor in tensors:
            assert torch.equal(seen[name], tensor), name


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run(
        [sys.executable, "-W", "always::RuntimeWarning", "-c", textwrap.dedent(code)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


FALLBACK_PROBE = """
    import torch, warnings
    from weight_sync import BucketPacker, unpack
    from weight_sync.checksum import algorithm_for, checksum
    tensors = [("a", torch.randn(100)), ("b", torch.randn(50))]
    for buffer, manifest in BucketPacker(1 << 20).pack(tensors):
        print(manifest.checksum_algorithm)
        assert all(torch.equal(v, dict(tensors)[n]) for n, v in unpack(buffer, manifest))
    print(algorithm_for(torch.zeros(1)))
    # a receiver without the kernel
    print(checksum(torch.arange(10, dtype=torch.float32), "wxh64"))
"""


def test_without_a_compiler_falls_back_to_xxh3_with_one_warning(tmp_path):
    result = _run(
        FALLBACK_PROBE,
        {"PATH": str(tmp_path), "CC": "", "MILES_LIKE_NATIVE_CACHE": str(tmp_path / "c")},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[:2] == ["xxh3", "xxh3"]
    assert int(lines[2]) == checksum(
        torch.arange(10, dtype=torch.float32), "wxh64"
    )  # reference agrees
    assert result.stderr.count("native wxh64 kernel unavailable") == 1, result.stderr
    assert "no C compiler" in result.stderr


def test_kernel_builds_into_a_fresh_cache_keyed_by_source(tmp_path):
    result = _run(FALLBACK_PROBE, {"MILES_LIKE_NATIVE_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["wxh64", "wxh64"]
    assert "unavailable" not in result.stderr
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("wxh64-") and files[0].suffix == ".so", (
        files
    )


PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("loaded", f); fclose(f); }
}
"""


@pytest.mark.parametrize("foreign", ["world-writable", "another owner"])
def test_a_library_planted_in_the_shared_temp_dir_is_not_loaded(tmp_path, foreign):
    """Another user pre-creates the old fallback directory (the system temp dir's
    miles_like_native_UID) and plants a library under the name we would load: it must not run.
    The home cache is unusable (its path runs through a file), so the fallback is taken."""
    if foreign == "another owner" and os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    shared_tmp, marker = tmp_path / "tmp", tmp_path / "marker"
    planted_dir = shared_tmp / f"miles_like_native_{os.getuid()}"
    planted_dir.mkdir(parents=True)
    os.chmod(planted_dir, 0o777)
    if foreign == "another owner":
        os.chmod(planted_dir, 0o700)
        os.chown(planted_dir, os.getuid() + 4242, -1)
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C)
    cc = native_build.compiler()
    planted = planted_dir / native.library_name(cc)
    subprocess.run(
        [cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(planted), str(source)],
        check=True,
    )
    (tmp_path / "file").write_text("")
    env = {"TMPDIR": str(shared_tmp), "MILES_LIKE_NATIVE_CACHE": str(tmp_path / "file" / "c")}
    result = _run("from weight_sync import native; print(native.kernel() is None)", env)
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), "the planted library was loaded"
    assert result.stdout.split() == ["True"]
    assert result.stderr.count("native wxh64 kernel unavailable") == 1, result.stderr
    refusal = f"{planted_dir} is not a directory owned by uid {os.getuid()} with mode 0700"
    assert refusal in result.stderr


def test_the_temp_fallback_is_created_private_and_used(tmp_path):
    """Where the temp-dir fallback does not exist yet it is created with mode 0700 and the
    kernel is built and loaded there."""
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    (tmp_path / "file").write_text("")
    result = _run(
        FALLBACK_PROBE,
        {"TMPDIR": str(shared_tmp), "MILES_LIKE_NATIVE_CACHE": str(tmp_path / "file" / "c")},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["wxh64", "wxh64"]
    directory = shared_tmp / f"miles_like_native_{os.getuid()}"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert [p.suffix for p in directory.iterdir()] == [".so"]
