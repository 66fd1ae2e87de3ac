"""Membership sources (collectors/membership.py): the diff of two fleets, the rules a new
set must keep against the others, and the watched file -- read again when replaced by
rename, a bad file refused once with the last good fleet kept."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvmiss.collectors.membership import (
    STATIC,
    Desired,
    FileSource,
    FleetMembers,
    Refusal,
    RefusalReason,
    build_sources,
    diff_fleet,
)
from kvmiss.schemas.config import ConfigError, FleetConfig, WorkerSpec, parse_config, parse_fleet_file


def spec(i: str, port: int, **kw) -> WorkerSpec:
    return WorkerSpec(id=i, endpoint=f"tcp://127.0.0.1:{port}", **kw)


def workers_toml(*items: tuple[str, int]) -> str:
    return "".join(f'[[workers]]\nid = "{i}"\nendpoint = "tcp://127.0.0.1:{p}"\n' for i, p in items)


def poll(source):
    return asyncio.run(source.poll())


# --- the diff -----------------------------------------------------------------------------

def test_diff_names_joins_and_departures_and_leaves_the_unchanged_alone():
    current = {"a": spec("a", 1), "b": spec("b", 2)}
    change = diff_fleet(current, [spec("b", 2), spec("c", 3)], at=5.0, source="file")
    assert change.joined == (spec("c", 3),)
    assert change.departed == ("a",)
    assert (change.at, change.source) == (5.0, "file")
    assert diff_fleet(current, current.values(), at=6.0, source="file").empty


def test_a_new_endpoint_under_the_same_id_departs_and_joins_again():
    change = diff_fleet({"a": spec("a", 1)}, [spec("a", 9)], at=1.0, source="file")
    assert change.departed == ("a",) and change.joined == (spec("a", 9),)
    # Any field counts: the same endpoint with another replay endpoint is another process's.
    change = diff_fleet({"a": spec("a", 1)}, [spec("a", 1, replay_endpoint="tcp://127.0.0.1:7")], at=1.0, source="f")
    assert change.departed == ("a",) and len(change.joined) == 1


# --- FleetMembers ---------------------------------------------------------------------------

def test_a_source_cannot_list_an_id_another_source_lists():
    members = FleetMembers([spec("s0", 1)])
    refused = members.propose("file", Desired((spec("s0", 2),)), at=1.0)
    assert isinstance(refused, Refusal) and refused.reason is RefusalReason.ID_CLASH
    assert "'s0'" in refused.detail and STATIC in refused.detail
    assert members.members() == {"s0": spec("s0", 1)}  # nothing changed


def test_a_source_cannot_subscribe_to_another_sources_endpoint():
    members = FleetMembers([spec("s0", 1)])
    refused = members.propose("file", Desired((spec("f0", 1),)), at=1.0)
    assert isinstance(refused, Refusal) and refused.reason is RefusalReason.ID_CLASH


def test_proposals_diff_against_the_sources_own_last_set():
    members = FleetMembers([spec("s0", 1)])
    first = members.propose("file", Desired((spec("f0", 2), spec("f1", 3))), at=1.0)
    assert [s.id for s in first.joined] == ["f0", "f1"] and first.departed == ()
    second = members.propose("file", Desired((spec("f1", 3),)), at=2.0)
    assert second.joined == () and second.departed == ("f0",)  # s0 is not the file's to remove
    assert sorted(members.members()) == ["f1", "s0"]


def test_a_duplicate_in_the_sources_own_answer_is_named_as_such():
    refused = FleetMembers().propose("dns", Desired((spec("a", 1), spec("a", 2))), at=1.0)
    assert refused.reason is RefusalReason.DUPLICATE_ID


# --- the fleet file's rules: the main config's [[workers]] ----------------------------------

def test_the_fleet_file_is_checked_by_the_config_parser_rules():
    assert [w.id for w in parse_fleet_file(workers_toml(("a", 1), ("b", 2)))] == ["a", "b"]
    assert parse_fleet_file("workers = []") == []
    cases = {
        "": "empty",
        "# only a comment\n": "empty",
        "[[workers]\n": "not_toml",
        '[[workers]]\nid = "a"\nendpoint = "tcp://h:1"\ndp_rank = "x"\n': "invalid",
        '[[workers]]\nid = "a"\nendpoint = "tcp://h:1"\ncolour = 1\n': "invalid",
        '[otlp]\ngrpc = ""\n': "invalid",  # a fleet file holds workers only
        workers_toml(("a", 1), ("a", 2)): "duplicate_id",
        workers_toml(("a", 1), ("b", 1)): "duplicate_endpoint",
    }
    for text, reason in cases.items():
        with pytest.raises(ConfigError) as err:
            parse_fleet_file(text, source="fleet.toml")
        assert err.value.reason == reason, text
        assert str(err.value).startswith("fleet.toml: ")
    with pytest.raises(ConfigError, match=r"workers\[0\]\.dp_rank"):
        parse_fleet_file('[[workers]]\nid = "a"\nendpoint = "tcp://h:1"\ndp_rank = "x"\n')


def test_fleet_section_keys_are_validated_naming_the_key():
    config = parse_config('[fleet]\nfile = "/etc/kvmiss/fleet.toml"\n')
    assert config.fleet.file == "/etc/kvmiss/fleet.toml"
    assert (config.fleet.poll_interval_s, config.fleet.membership_uncertainty_s) == (0.25, 0.5)
    for text, key in (('file = " "', "fleet.file"), ("poll_interval_s = 0", "fleet.poll_interval_s"),
                      ("poll_interval_s = 120", "fleet.poll_interval_s"),
                      ("poll_interval_s = nan", "fleet.poll_interval_s"),
                      ("membership_uncertainty_s = 0.1", "fleet.membership_uncertainty_s"),
                      ("membership_uncertainty_s = inf", "fleet.membership_uncertainty_s"),
                      ("colour = 1", "unknown field `colour` at `fleet`")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_config(f"[fleet]\n{text}\n")


# --- the watched file --------------------------------------------------------------------------

def replace(path, text: str) -> None:
    """As a ConfigMap, a sidecar or a deploy tool writes it: a new file renamed over the old."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def test_the_file_is_read_when_replaced_by_rename_and_not_otherwise(tmp_path):
    path = tmp_path / "fleet.toml"
    replace(path, workers_toml(("a", 1)))
    source = FileSource(str(path))
    assert [s.id for s in poll(source).specs] == ["a"]
    assert poll(source) is None  # unchanged: not read again
    replace(path, workers_toml(("a", 1), ("b", 2)))  # same second, another inode
    assert [s.id for s in poll(source).specs] == ["a", "b"]
    # Rewritten in place to the same size within the same mtime tick still changes ctime/mtime_ns.
    assert poll(source) is None


def test_a_missing_file_is_refused_once_and_followed_once_it_appears(tmp_path):
    path = tmp_path / "fleet.toml"
    source = FileSource(str(path))
    first = poll(source)
    assert isinstance(first, Refusal) and first.reason is RefusalReason.MISSING
    assert poll(source) is None  # once, not at every poll
    replace(path, workers_toml(("a", 1)))
    assert [s.id for s in poll(source).specs] == ["a"]


def test_a_bad_file_is_refused_once_and_a_good_one_after_it_is_taken(tmp_path):
    path = tmp_path / "fleet.toml"
    replace(path, workers_toml(("a", 1), ("a", 2)))
    source = FileSource(str(path))
    refused = poll(source)
    assert isinstance(refused, Refusal) and refused.reason is RefusalReason.DUPLICATE_ID
    assert "duplicate id 'a'" in refused.detail
    assert poll(source) is None
    replace(path, b"\xff\xfe not text".decode("latin-1"))
    assert poll(source).reason in (RefusalReason.NOT_TOML,)
    replace(path, workers_toml(("a", 1)))
    assert isinstance(poll(source), Desired)


def test_a_symlink_swap_as_a_configmap_volume_does_is_seen(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    (tmp_path / "v1" / "fleet.toml").write_text(workers_toml(("a", 1)))
    (tmp_path / "v2" / "fleet.toml").write_text(workers_toml(("b", 2)))
    os.symlink("v1", tmp_path / "..data")
    os.symlink("..data/fleet.toml", tmp_path / "fleet.toml")
    source = FileSource(str(tmp_path / "fleet.toml"))
    assert [s.id for s in poll(source).specs] == ["a"]
    os.symlink("v2", tmp_path / "..data_tmp")
    os.rename(tmp_path / "..data_tmp", tmp_path / "..data")
    assert [s.id for s in poll(source).specs] == ["b"]


def test_build_sources_follows_the_fleet_section(tmp_path):
    assert build_sources(FleetConfig()) == []
    source, engines = build_sources(FleetConfig(file=str(tmp_path / "f.toml")))
    assert (source.name, source.where) == ("file", str(tmp_path / "f.toml"))
    assert engines.name == "engines" and engines.file is source  # it asks the file's [[engines]]


def test_a_fleet_from_the_file_is_stamped_with_when_it_became_visible(tmp_path):
    """Not when kvmiss got round to reading it (a busy event loop reads it late, and the
    lookups between the router's switch and a late stamp would be judged on the old fleet),
    and not with a modification time a copy kept (``cp -p``): with the file's ctime, held
    between the previous poll, which still saw the old file, and now."""
    path = tmp_path / "fleet.toml"
    source = FileSource(str(path))
    path.write_text('[[workers]]\nid = "a"\nendpoint = "tcp://127.0.0.1:5557"\n')
    first = asyncio.run(source.poll())
    assert first.at == pytest.approx(os.stat(path).st_ctime_ns / 1e9, abs=1e-6)
    assert first.at <= time.time()

    time.sleep(0.05)
    polled = time.time()
    assert asyncio.run(source.poll()) is None  # unchanged: this poll still saw the old file
    time.sleep(0.05)
    tmp = tmp_path / "fleet.toml.tmp"
    tmp.write_text('[[workers]]\nid = "b"\nendpoint = "tcp://127.0.0.1:5558"\n')
    day_ago = int((time.time() - 86400) * 1e9)
    os.utime(tmp, ns=(day_ago, day_ago))  # as cp -p or rsync -t leave it
    os.rename(tmp, path)
    renamed = time.time()
    answer = asyncio.run(source.poll())
    assert polled <= answer.at <= renamed + 0.01, (polled, answer.at, renamed)
    change = FleetMembers().propose("file", answer, answer.at)
    assert change.at == answer.at
