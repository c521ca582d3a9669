"""Damaged, forged and oversized checkpoints: refused on every rank, naming the file and the field, nothing written."""

import functools
import json
import os
import shutil
from pathlib import Path

import pytest
from checkpoint_runs import consolidate_from, copy_of, edit, refused, resume_from, train

from mpizero import checkpoint_key
from mpizero.checkpoint import manifest as manifest_format

# Damage to the rank files: each names the file (and what it contradicts).


def truncate(path: Path) -> str:
    data = (path / "rank00001.bin").read_bytes()
    (path / "rank00001.bin").write_bytes(data[:-8])
    return f"rank00001.bin: {len(data) - 8} bytes, the manifest's layout says {len(data)} (truncated or replaced)"


def flip_a_byte(path: Path) -> str:
    data = bytearray((path / "rank00002.bin").read_bytes())
    data[100] ^= 1
    (path / "rank00002.bin").write_bytes(bytes(data))
    return "rank00002.bin: bytes [0, "  # the first block: "... do not match their digest (the file changed)"


def flip_a_digest(path: Path) -> str:
    data = bytearray((path / "rank00000.bin").read_bytes())
    data[-1] ^= 1
    (path / "rank00000.bin").write_bytes(bytes(data))
    return "rank00000.bin: its digest table does not match the manifest (the file changed)"


def delete_a_file(path: Path) -> str:
    (path / "rank00003.bin").unlink()
    return "rank00003.bin: missing"


def a_fifo_instead(path: Path) -> str:
    (path / "rank00001.bin").unlink()
    os.mkfifo(path / "rank00001.bin")
    return "rank00001.bin: not a regular file"


def a_symlink_loop(path: Path) -> str:
    (path / "rank00001.bin").unlink()
    os.symlink("rank00001.bin", path / "rank00001.bin")
    return "rank00001.bin: cannot read it (Too many levels of symbolic links)"


@pytest.mark.parametrize(
    "damage", [truncate, flip_a_byte, flip_a_digest, delete_a_file, a_fifo_instead, a_symlink_loop]
)
def test_damaged_rank_files_fail_on_every_rank_naming_file_and_problem(tmp_path, saved, damage):
    path = copy_of(saved, tmp_path)
    expected = damage(path)
    line = refused(tmp_path, path, resume_from(path, tmp_path, n=3), expected)
    assert "cannot load checkpoint" in line


# Damage to the manifest. ``edit`` changes it as a careless hand would; ``sealed`` also recomputes
# its checksum, as a buggy writer would, so the structure checks behind the checksum are exercised.


def edit_step(m):
    m["training"]["step"] = 2


def widen_a_tensor(m):
    m["tensors"][0]["shape"] = [64, 99]


def swap_digests(m):
    m["files"][0], m["files"][1] = m["files"][1], m["files"][0]


def drop_a_tensor_from_its_group(m):
    m["partition"]["groups"][0].remove("l1.b")


def place_a_tensor_twice(m):
    m["partition"]["groups"][0].append("l1.b")


def group_an_unknown_tensor(m):
    m["partition"]["groups"].append(["l9.w"])


def align_zero(m):
    m["partition"]["align"] = 0


def odd_block_bytes(m):
    m["block_bytes"] = 65535


def small_blocks(m):
    m["block_bytes"] = 512


def one_digest_short(m):
    m["files"].pop()


def a_digest_in_upper_case(m):
    m["files"][2] = m["files"][2].upper()


def settings_as_a_list(m):
    m["training"]["settings"] = []


def a_name_with_a_slash(m):
    for tensor in m["tensors"]:
        tensor["name"] = tensor["name"].replace("l2.w", "l2.w/exp_avg")
    m["partition"]["groups"][0] = [n.replace("l2.w", "l2.w/exp_avg") for n in m["partition"]["groups"][0]]
    m["scales"]["l2.w/exp_avg"] = m["scales"].pop("l2.w")


def negative_step(m):
    m["training"]["step"] = -1


def step_as_text(m):
    m["training"]["step"] = "4"


def bad_checksum(m):
    m["checksum"] = "0" * 64


def field_of(m, name):
    """What a sealed damage's refusal names, found from the manifest before the damage."""
    fields = {
        swap_digests: lambda: ".bin: its digest table does not match the manifest",
        drop_a_tensor_from_its_group: lambda: "manifest.json: field partition.groups: 1 tensors are in no group",
        place_a_tensor_twice: lambda: "manifest.json: field partition.groups[0][{}]: 'l1.b' is also in".format(
            len(m["partition"]["groups"][0])
        ),
        group_an_unknown_tensor: lambda: "manifest.json: field partition.groups[1][0]: 'l9.w' is not in tensors",
        align_zero: lambda: "manifest.json: field partition.align: must be an integer in [1, 1073741824], got 0",
        odd_block_bytes: lambda: "manifest.json: field block_bytes: must be a power of two, got 65535",
        small_blocks: lambda: "the manifest's layout says",  # a longer digest table than the file holds
        one_digest_short: lambda: "manifest.json: field files: must be a list of 4",
        a_digest_in_upper_case: lambda: "manifest.json: field files[2]: must be 64 lowercase hex digits",
        settings_as_a_list: lambda: "manifest.json: field training.settings: must be an object, got []",
        a_name_with_a_slash: lambda: "'l2.w/exp_avg' must be printable, without '/' (consolidate's NAME/STATE)",
        negative_step: lambda: "manifest.json: field training.step: must be an integer >= 0, got -1",
        step_as_text: lambda: "manifest.json: field training.step: must be an integer >= 0, got '4'",
    }
    return fields[name]()


UNSEALED = [edit_step, widen_a_tensor, swap_digests, drop_a_tensor_from_its_group]
SEALED = [
    swap_digests,
    drop_a_tensor_from_its_group,
    place_a_tensor_twice,
    group_an_unknown_tensor,
    align_zero,
    odd_block_bytes,
    small_blocks,
    one_digest_short,
    a_digest_in_upper_case,
    settings_as_a_list,
    a_name_with_a_slash,
]


def damage_manifest(path: Path, change, seal: bool) -> str:
    """Apply ``change``; return the text the refusal must contain (file and field)."""
    original = json.loads((path / "manifest.json").read_text())
    edit(path, change, seal=seal)
    if not seal or change is bad_checksum:
        return "manifest.json: field checksum: "
    return field_of(original, change)


@pytest.mark.parametrize("seal, change", [(False, c) for c in [*UNSEALED, bad_checksum]] + [(True, c) for c in SEALED])
def test_manifest_damage_is_refused_on_resume(tmp_path, saved, seal, change):
    path = copy_of(saved, tmp_path)
    expected = damage_manifest(path, change, seal)
    refused(tmp_path, path, resume_from(path, tmp_path), expected)


@pytest.mark.parametrize("seal, change", [(False, c) for c in [edit_step, swap_digests]] + [(True, c) for c in SEALED])
def test_manifest_damage_is_refused_by_consolidate(tmp_path, saved, seal, change):
    path = copy_of(saved, tmp_path)
    expected = damage_manifest(path, change, seal)
    refused(tmp_path, path, consolidate_from(path, tmp_path), expected)


def test_a_tensor_widened_under_a_recomputed_checksum_is_refused(tmp_path, saved):
    """Resume names the model that differs; consolidate, which has no model, finds the files too short for it."""
    path = copy_of(saved, tmp_path)
    edit(path, widen_a_tensor)
    expected = "manifest.json: field tensors: saved from another model (l0.w: checkpoint [64, 99] vs model [64, 48])"
    refused(tmp_path, path, resume_from(path, tmp_path), expected)
    refused(tmp_path, path, consolidate_from(path, tmp_path), "the manifest's layout says")


@pytest.mark.parametrize("change", [negative_step, step_as_text])
def test_training_state_fields_are_validated(tmp_path, saved, change):
    path = copy_of(saved, tmp_path)
    refused(tmp_path, path, resume_from(path, tmp_path), damage_manifest(path, change, seal=True))


def test_a_step_that_disagrees_with_the_counters_is_refused(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    edit(path, edit_step)
    refused(tmp_path, path, resume_from(path, tmp_path), "manifest.json: field training.step: 2, but optimizer_steps 4")


# Signed checkpoints, and manifests parsed with limits.

KEY = checkpoint_key.KEY_VARIABLE


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("signed") / "ckpt"
    train(1, 1, 2, "--checkpoint-dir", directory, "--checkpoint-every", 2, env={KEY: "the key"})
    return directory / "ckpt-00000002"


def test_a_signed_checkpoint_loads_only_under_its_key(tmp_path, signed, saved):
    assert "signature" in json.loads((signed / "manifest.json").read_text())
    manifest_format.read(str(signed), None)  # no key: the checksum is checked, the signature cannot be
    manifest_format.read(str(signed), b"the key")
    with pytest.raises(manifest_format.CheckpointError, match="field signature: missing: the checkpoint is unsigned"):
        manifest_format.read(str(saved / "ckpt-00000004"), b"the key")
    with pytest.raises(manifest_format.CheckpointError, match="field signature: does not match"):
        manifest_format.read(str(signed), b"another key")
    key_file = tmp_path / "key"
    key_file.write_bytes(b"the key")
    assert checkpoint_key.read({checkpoint_key.KEY_FILE_VARIABLE: str(key_file)}) == b"the key"
    assert checkpoint_key.read({KEY: "the key", checkpoint_key.KEY_FILE_VARIABLE: str(key_file)}) == b"the key"
    assert checkpoint_key.read({}) is None


def test_a_forged_manifest_with_a_recomputed_checksum_is_refused_under_the_key(tmp_path, signed):
    path = tmp_path / "forged"
    shutil.copytree(signed, path)
    edit(path, lambda m: m["training"].update(step=1, optimizer_steps=1))  # checksum recomputed, as a forger would
    command = functools.partial(train, 1, 1, 3, "--resume", path, ok=False, env={KEY: "the key"})
    refused(tmp_path, path, command, "manifest.json: field signature: does not match")


def test_a_deeply_nested_manifest_is_one_clear_error(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    (path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    expected = "manifest.json: nested 100000 levels deep, more than the 16 allowed"
    line = refused(tmp_path, path, consolidate_from(path, tmp_path), expected)
    assert "RecursionError" not in line


def test_an_oversized_manifest_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    (tmp_path / "manifest.json").write_text('{"a": "' + "x" * 100 + '"}')
    monkeypatch.setattr(manifest_format, "MAX_BYTES", 64)
    with pytest.raises(manifest_format.CheckpointError, match="larger than 64 bytes"):
        manifest_format.read(str(tmp_path), None)
    assert manifest_format.nesting_depth(b'{"a": ["[[[", {"b": "]}"}]}') == 3


def test_a_manifest_of_escaped_quotes_is_refused_at_once(tmp_path):
    """Its nesting is measured in linear time: a regex over strings took hours on 1 MB of this."""
    (tmp_path / "manifest.json").write_bytes(b'"' + b'\\"' * (4 << 20))
    with pytest.raises(manifest_format.CheckpointError, match="manifest.json: unreadable"):
        manifest_format.read(str(tmp_path), None)


def test_a_tensor_too_large_for_its_files_is_refused_before_anything_is_allocated(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    edit(path, lambda m: m["tensors"][0].update(shape=[10**6, 10**6]))  # 4 TB of float32, were it allocated
    refused(tmp_path, path, consolidate_from(path, tmp_path), "the manifest's layout says")


def test_a_non_ascii_signature_is_refused_under_the_key(tmp_path, signed):
    path = tmp_path / "forged"
    shutil.copytree(signed, path)
    edit(path, lambda m: m.update(signature="\u00e9" * 64))
    with pytest.raises(manifest_format.CheckpointError, match="field signature: does not match"):
        manifest_format.read(str(path), b"the key")


def test_a_checkpoint_is_never_used_as_a_checkpoint_directory(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    command = functools.partial(
        train, 2, 2, 6, "--resume", path, "--checkpoint-dir", path, "--checkpoint-every", 1, ok=False
    )
    refused(tmp_path, path, command, f"{path} is a checkpoint itself")


def test_a_manifest_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "manifest.json")
    expected = "manifest.json is a FIFO, not a regular file: refused without reading it"
    with pytest.raises(manifest_format.CheckpointError, match=expected):
        manifest_format.read(str(tmp_path), None)
