"""What a user meets when something they gave or asked for is wrong: one message naming it and exit status 2
(the traceback with --debug); a run folder that does not exist, is empty or holds no archive is such an error
for every command that reads a finished run; a bug keeps its traceback. And each command's --help says what
--bootstrap-servers and --redis-url mean to it: only `run` and `topics` start embedded services."""
from __future__ import annotations

import subprocess
import sys

import pytest

from milestream.cli import COMMANDS, SERVICES, USER_ERROR, main
from milestream.config import load_config

READERS_OF_A_FINISHED_RUN = (
    ["audit"], ["replay"], ["replay", "--list"], ["replay", "--group", "g#0", "--show"], ["replay", "--step", "1"],
    ["plot"], ["mismatch", "--worst", "1"], ["export", "--out", "{tmp}/exported"], ["track", "--tensorboard"],
)


def _folder(kind: str, tmp_path) -> str:
    folder = tmp_path / "run"
    if kind != "missing":
        folder.mkdir()
    if kind == "without an archive":
        (folder / "summary.json").write_text("{}")
    return str(folder)


def _reading(command: list[str], folder: str, tmp_path) -> list[str]:
    argv = [part.format(tmp=tmp_path) for part in command]
    where = ["--from-archive", folder] if argv[0] == "track" else ["--run-dir", folder]
    return [*argv, *where, "--log-level", "WARNING"]


@pytest.mark.parametrize("kind", ["missing", "empty"])
@pytest.mark.parametrize("command", READERS_OF_A_FINISHED_RUN, ids=" ".join)
def test_every_reader_of_a_finished_run_refuses_a_missing_or_empty_folder(command, kind, tmp_path, capsys):
    folder = _folder(kind, tmp_path)
    assert main(_reading(command, folder, tmp_path)) == USER_ERROR
    out, err = capsys.readouterr()
    assert f"milestream {command[0]}: {folder}: " in err
    assert ("no such run folder" if kind == "missing" else "an empty folder") in err
    assert "Traceback" not in err and '"exact"' not in out


@pytest.mark.parametrize("command", [c for c in READERS_OF_A_FINISHED_RUN if c[0] not in ("plot", "export")],
                         ids=" ".join)
def test_a_folder_without_an_archive_is_named_by_every_reader_of_the_archive(command, tmp_path, capsys):
    folder = _folder("without an archive", tmp_path)
    assert main(_reading(command, folder, tmp_path)) == USER_ERROR
    err = capsys.readouterr().err
    assert f"{folder}: no archive in this run folder" in err and "Traceback" not in err


def test_the_traceback_of_a_user_error_is_kept_for_debug(tmp_path, capsys):
    missing = str(tmp_path / "nothing")
    for argv in (["--debug", "audit", "--run-dir", missing], ["audit", "--run-dir", missing, "--debug"]):
        assert main(argv) == USER_ERROR
        err = capsys.readouterr().err
        assert "Traceback" in err and "RunFolderError" in err
        assert err.rstrip().endswith(f"milestream audit: {missing}: no such run folder; --run-dir names the folder "
                                     "of a run (`milestream run` writes to run.run_dir, by default runs/latest)")


@pytest.mark.parametrize("argv, message", [
    (["run", "--set", "data.path={tmp}/absent.jsonl"], "data file {tmp}/absent.jsonl does not exist"),
    (["run", "--set", "trainer.correction=clip_or_drop"], "trainer.correction\n  Input should be"),
    (["run", "--set", "trainer"], "override 'trainer' is not of the form section.key=value"),
    (["run", "--config", "{tmp}/absent.yaml"], "configuration file {tmp}/absent.yaml"),
    (["router"], "router.engines needs at least one engine"),
    (["load-prompts", "--set", "reward.fn=absent_module:score"], "reward.fn 'absent_module:score' does not name"),
], ids=lambda value: value[0] if isinstance(value, list) else None)
def test_a_user_error_is_one_message_and_status_2(argv, message, tmp_path):
    """In a process of its own, as a user runs it: nothing but the message on stderr."""
    done = subprocess.run([sys.executable, "-m", "milestream.cli", *[a.format(tmp=tmp_path) for a in argv],
                           "--log-level", "WARNING"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == USER_ERROR, done.stderr
    assert done.stderr.startswith(f"milestream {argv[0]}: ") and message.format(tmp=tmp_path) in done.stderr
    assert "Traceback" not in done.stderr


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    def broken(cfg, args):
        raise KeyError("a bug")

    monkeypatch.setitem(COMMANDS, "audit", (broken, COMMANDS["audit"][1]))
    with pytest.raises(KeyError, match="a bug"):
        main(["audit", "--run-dir", str(tmp_path)])


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_only_run_and_topics_say_they_start_embedded_services(capsys):
    helps = {name: _help(name, capsys) for name in COMMANDS}
    assert {name for name, text in helps.items() if "embedded" in text} == {"run", "topics"}
    for name in COMMANDS:
        broker, redis = SERVICES.get(name, (None, None))
        assert (broker is not None) == ("--bootstrap-servers" in helps[name]), name
        assert (redis is not None) == ("--redis-url" in helps[name]), name
    assert "the one --config, else RUN_DIR/config.yaml, names" in helps["mismatch"]
    assert "--debug" in helps["export"]
    # a flag a command does not use is still accepted, as before
    assert main(["export", "--bootstrap-servers", "k:9092", "--run-dir", "absent", "--out", "x"]) == USER_ERROR


def test_the_exit_statuses_are_in_the_help():
    done = subprocess.run([sys.executable, "-m", "milestream.cli", "--help"], capture_output=True, text=True,
                          check=True)
    assert "exit status:" in done.stdout and "--debug adds the traceback" in done.stdout


def test_correction_is_accepted_as_written_in_prose(tmp_path):
    assert load_config(None, ["trainer.correction=clip-or-pop"]).trainer.correction == "clip_or_pop"
    written = tmp_path / "c.yaml"
    written.write_text("trainer:\n  correction: clip-or-pop\n")
    assert load_config(written).trainer.correction == "clip_or_pop"
    assert load_config(None, ["trainer.correction=clip_or_pop"]).trainer.correction == "clip_or_pop"
