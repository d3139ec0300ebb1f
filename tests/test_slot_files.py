"""features/slot_files.py: named files with host copies and device slots, without a model (the engines that use it:
test_controlnet.py, test_ip_adapter.py, test_capabilities.py's Bias, LoRA's folder and slot table in test_lora_*.py)."""

import os
import time
from types import SimpleNamespace

import pytest

from diffgraph.errors import ParamError
from diffgraph.features.slot_files import Folder, SlotFiles, names_in


class Loads:
    """A `load` that records what it read and returns a fresh host copy (a list: weakly referable through a class)."""

    def __init__(self):
        self.read = []

    def __call__(self, name, path):
        self.read.append(name)
        with open(path) as f:
            return HostCopy([name, f.read()])


class HostCopy(list):
    pass


@pytest.fixture
def folder(tmp_path):
    for name in ("a", "b", "c", "sub/d"):
        path = tmp_path / f"{name}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)
    (tmp_path / "e.ckpt").write_text("pickle")
    return Folder(str(tmp_path), what="thing", label="things folder", param="things")


def _files(folder, slots=2, keep=None, place=None):
    loads = Loads()
    placed = {}
    files = SlotFiles("things", "things", folder.locate, loads, slots=slots, keep=keep,
                      place=place or (lambda slot, host: placed.__setitem__(slot, host[0])), listing=folder.names,
                      limit="--max-things", what="thing")
    return files, loads, placed


def _state(held):
    return SimpleNamespace(prepared={"things.files": held})


def test_a_folder_lists_and_locates_its_names_and_refuses_the_others(folder):
    assert folder.names() == ["a", "b", "c", "sub/d"] and folder.listing().ignored == ["e.ckpt"]
    path, version = folder.locate("sub/d")
    assert path.endswith(os.path.join("sub", "d.safetensors")) and version
    for name, words in (("../a", "is not allowed"), ("/a", "is not allowed"), ("", "non-empty"),
                        ("aa", "thing 'aa' is unknown; did you mean 'a'?")):
        with pytest.raises(ParamError) as e:
            folder.locate(name)
        assert e.value.param == "things" and words in str(e.value)


def test_host_copies_are_kept_for_the_most_recent_and_shared_while_held(folder):
    files, loads, _ = _files(folder, slots=2, keep=1)
    a = files.resolve(["a", "a"])  # one per distinct name
    assert [h.name for h in a] == ["a"] and loads.read == ["a"]
    b = files.resolve(["b"])
    assert files.resolve(["b"])[0].host is b[0].host and loads.read == ["a", "b"]  # cached
    assert files.resolve(["a"])[0].host is a[0].host and loads.read == ["a", "b"]  # dropped, but held: shared
    del a
    files.resolve(["c"])  # `a` was the most recent one cached; now `c` is, and nothing holds `a`
    files.resolve(["a"])
    assert loads.read == ["a", "b", "c", "a"]
    with pytest.raises(ParamError, match=r"names 3 different things; this server holds at most 2 at once "
                                         r"\(--max-things\): use at most 2, or start the server with --max-things 3"):
        files.resolve(["a", "b", "c"])


def test_a_rewritten_file_is_a_new_version_with_a_slot_of_its_own(folder):
    files, loads, placed = _files(folder, slots=2)
    old = _state(files.resolve(["a"]))
    assert files.admit(old) == [1] and files.load_admitted() == {} and placed == {1: "a"}
    time.sleep(0.01)
    with open(os.path.join(folder.root, "a.safetensors"), "w") as f:
        f.write("a, again")
    new = _state(files.resolve(["a"]))
    assert new.prepared["things.files"][0].key != old.prepared["things.files"][0].key and loads.read == ["a", "a"]
    assert files.admit(new) == [2] and files.load_admitted() == {}  # rows in flight keep slot 1's version


def test_the_gate_waits_for_slots_and_reuses_the_least_recently_used(folder):
    files, _, placed = _files(folder, slots=2)
    ab, c, plain = _state(files.resolve(["a", "b"])), _state(files.resolve(["c"])), _state(())
    assert files.can_admit(plain) and files.admit(plain) == []  # a request naming none: nothing to gate
    assert files.admit(ab) == [1, 2] and files.load_admitted() == {} and placed == {1: "a", 2: "b"}
    assert not files.can_admit(c) and files.admit(c) is None  # every slot pinned: it waits
    again = _state(files.resolve(["b"]))
    assert files.admit(again) == [2] and files._writes == []  # held already: pinned again, not written again
    files.release(ab, [1, 2])
    files.release(again, [2])
    assert files.can_admit(c) and files.admit(c) == [1]  # slot 1 (a) was used least recently
    assert files.load_admitted() == {} and placed == {1: "c", 2: "b"}
    assert files.slot_map(c, [1]) == {"c": 1}


def test_a_file_that_cannot_be_placed_fails_its_slot_alone(folder):
    def place(slot, host):
        if host[0] == "b":
            raise RuntimeError("out of memory")
    files, _, _ = _files(folder, slots=2, place=place)
    a, b = _state(files.resolve(["a"])), _state(files.resolve(["b"]))
    assert files.admit(a) == [1] and files.admit(b) == [2]
    assert files.load_admitted() == {2: "out of memory"}
    assert files.slots.holding()[2] == (None, 1)  # forgotten: the next request naming it places it again


def test_the_names_a_parameter_holds():
    assert names_in(None, "things") == [] and names_in("a", "things") == ["a"]
    assert names_in(["a", {"name": "b"}, SimpleNamespace(name="c")], "things") == ["a", "b", "c"]
    for bad in (3, [{"scale": 1}], [None]):
        with pytest.raises(ParamError) as e:
            names_in(bad, "things")
        assert e.value.param == "things" and "must name files" in str(e.value)


def test_a_file_its_reader_cannot_read_is_refused_by_name(folder):
    def load(name, path):
        raise OSError("truncated header")
    files = SlotFiles("things", "things", folder.locate, load, slots=1, what="thing")
    with pytest.raises(ParamError) as e:
        files.resolve(["a"])
    assert e.value.param == "things" and "thing 'a' could not be read (OSError: truncated header)" in str(e.value)


def test_requests_holding_names_only_get_dropped_copies_read_again_at_admission_within_a_byte_bound(folder):
    """LoRA's mode: host copies bounded by bytes, read on a pool; a request holds (name, version, source) only."""
    from diffgraph.safe_files import FileReader

    loads, woken = Loads(), []
    files = SlotFiles("things", "things", folder.locate, loads, slots=2, keep=3, place=lambda slot, host: None,
                      weigh=lambda host: len(host[1]), max_bytes=1, reader=FileReader(1, 30.0), what="thing")
    files.wake = lambda: woken.append(True)
    queued = [_state((SimpleNamespace(key=h.key, host=None, source=h.source),)) for h in
              (files.held(n) for n in ("a", "b"))]
    assert files.host_bytes() == 1 and files.peek(queued[0].prepared["things.files"][0].key) is None  # a: dropped
    assert not files.can_admit(queued[0])  # read again on the pool, off the loop; it waits meanwhile
    deadline = time.monotonic() + 30
    while not files.can_admit(queued[0]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert woken and loads.read == ["a", "b", "a"]
    assert files.admit(queued[0]) == [1] and files.load_admitted() == {}
    files.held("c")  # b dropped; its file goes away before its request is admitted: that request fails alone
    os.remove(os.path.join(folder.root, "b.safetensors"))
    while not files.can_admit(queued[1]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    slot = files.admit(queued[1])[0]
    assert "thing 'b' could not be read again at admission" in files.load_admitted()[slot]
