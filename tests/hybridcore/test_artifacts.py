"""Unit tests for hybridcore.artifacts: atomic, hash-verified `<root>/<stage>/<key>/` folders."""
import hashlib
import json

from hybridcore.artifacts import (MANIFEST, artifact_dir, file_hashes, publish, read_verified, sha256_file,
                                  staging_dir)

FILES = {"model.safetensors": b"\x00\x01weights" * 100, "config.json": b'{"a": 1}', "sub/tokenizer.json": b"{}"}


def write_files(folder, files=FILES):
    for rel, data in files.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def make_artifact(root, stage="sft", key="abc123", files=FILES, **meta):
    tmp = staging_dir(root, stage, key)
    write_files(tmp, files)
    return publish(tmp, dict(meta))


def test_staging_dir_is_fresh_partial_folder(tmp_path):
    """staging_dir gives an empty <root>/<stage>/<key>.partial/, clearing leftovers from a crashed run."""
    tmp = staging_dir(tmp_path, "sft", "k1")
    assert tmp == tmp_path / "sft" / "k1.partial" and tmp.is_dir() and not any(tmp.iterdir())
    (tmp / "junk.bin").write_bytes(b"half written")
    again = staging_dir(tmp_path, "sft", "k1")
    assert again == tmp and not any(again.iterdir())


def test_publish_writes_manifest_and_renames(tmp_path):
    """publish gives <root>/<stage>/<key>/ with a manifest of every file's sha256; .partial is gone."""
    final = make_artifact(tmp_path, stage="sft", key="abc123", params={"lr": 1e-4}, metric=0.5)
    assert final == artifact_dir(tmp_path, "sft", "abc123") == tmp_path / "sft" / "abc123"
    assert final.is_dir()
    assert not (tmp_path / "sft" / "abc123.partial").exists()
    assert sorted(p.name for p in (tmp_path / "sft").iterdir()) == ["abc123"]
    assert not (final / (MANIFEST + ".tmp")).exists()
    manifest = json.loads((final / MANIFEST).read_text())
    assert manifest["files"] == {rel: hashlib.sha256(data).hexdigest() for rel, data in FILES.items()}
    assert manifest["params"] == {"lr": 1e-4} and manifest["metric"] == 0.5 and "created" in manifest
    assert read_verified(final) == manifest
    for rel, data in FILES.items():
        assert (final / rel).read_bytes() == data


def test_file_hashes_skips_manifest_and_checkpoints(tmp_path):
    """file_hashes lists nested files by relative path, but not the manifest or checkpoints/ contents."""
    write_files(tmp_path, {**FILES, MANIFEST: b"{}", "checkpoints/step1/opt.pt": b"x"})
    hashes = file_hashes(tmp_path)
    assert set(hashes) == set(FILES)
    assert hashes["sub/tokenizer.json"] == sha256_file(tmp_path / "sub" / "tokenizer.json")
    assert hashes["sub/tokenizer.json"] == hashlib.sha256(b"{}").hexdigest()


def test_modified_byte_fails_verification(tmp_path):
    """Flipping one byte in a listed file makes read_verified return None."""
    final = make_artifact(tmp_path)
    p = final / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[57] ^= 0x01
    p.write_bytes(bytes(data))
    assert read_verified(final) is None


def test_deleted_file_fails_verification(tmp_path):
    """Deleting a listed (nested) file makes read_verified return None."""
    final = make_artifact(tmp_path)
    (final / "sub" / "tokenizer.json").unlink()
    assert read_verified(final) is None


def test_truncated_or_missing_manifest_fails_verification(tmp_path):
    """A truncated, empty, non-dict or missing manifest makes read_verified return None."""
    final = make_artifact(tmp_path)
    m = final / MANIFEST
    text = m.read_text()
    m.write_text(text[: len(text) // 2])
    assert read_verified(final) is None
    m.write_text("")
    assert read_verified(final) is None
    m.write_text("[1, 2]")
    assert read_verified(final) is None
    m.write_text(json.dumps({"created": "x"}))  # no "files"
    assert read_verified(final) is None
    m.unlink()
    assert read_verified(final) is None
    assert read_verified(tmp_path / "nope") is None


def test_publish_replaces_unverified_leftover(tmp_path):
    """publish over an existing, unverified <key>/ folder replaces it entirely and leaves no stale copy."""
    old = tmp_path / "rm" / "k9"
    write_files(old, {"stale.bin": b"old", "model.safetensors": b"truncated"})
    (old / MANIFEST).write_text('{"files": {"model.safetensors": "0000"')  # torn manifest
    assert read_verified(old) is None
    final = make_artifact(tmp_path, stage="rm", key="k9")
    assert final == old
    assert not (final / "stale.bin").exists()
    assert (final / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert read_verified(final) is not None
    assert sorted(p.name for p in (tmp_path / "rm").iterdir()) == ["k9"]


def test_republish_same_key_gives_new_contents(tmp_path):
    """Publishing a key twice leaves only the second version, verified."""
    make_artifact(tmp_path, key="k", run=1)
    final = make_artifact(tmp_path, key="k", files={"a.txt": b"second"}, run=2)
    manifest = read_verified(final)
    assert manifest["run"] == 2 and set(manifest["files"]) == {"a.txt"}
    assert sorted(p.name for p in final.iterdir()) == sorted(["a.txt", MANIFEST])
