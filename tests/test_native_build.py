"""native_build's cache key covers the headers a source includes: editing a header builds anew."""

from __future__ import annotations

import native_build


def test_an_edited_header_changes_the_library_name(tmp_path):
    cc = native_build.compiler()
    if cc is None:
        import pytest

        pytest.skip("no C compiler")
    source = tmp_path / "k.c"
    header = tmp_path / "k_math.h"
    source.write_text('#include "k_math.h"\nint f(void) { return K; }\n')
    header.write_text("#define K 1\n")
    assert native_build.headers_of(source) == [header]
    before = native_build.library_name(source, ["-O2"], cc)
    header.write_text("#define K 2\n")
    assert native_build.library_name(source, ["-O2"], cc) != before
    lib = native_build.load(source, ["-O2", "-shared", "-fPIC"])
    assert lib.f() == 2
