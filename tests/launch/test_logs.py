"""The workers' output: each console line names its rank, --log-dir keeps every worker's output in files,
--show-ranks picks whose the console shows, and a progress bar stays one line."""

from __future__ import annotations

import os
import re
import textwrap

import pytest

from dpkit.launch import LaunchError, launch
from dpkit.launch.logs import PARTIAL_LINE_SECONDS, ConsoleCopy, WorkerOutput, _Followed

# --- the console copy, line by line ---------------------------------------------------------------------


def lines_of(followed: _Followed, *chunks: str, final: bool = True, now: float = 0.0) -> str:
    out = "".join(followed._lines(chunk, False, now) for chunk in chunks)
    return out + (followed._lines("", True, now) if final else "")


def test_every_line_starts_with_its_rank_and_empty_lines_stay_empty():
    followed = _Followed("unused", "stdout", "[rank1]: ", {})
    assert lines_of(followed, "one\ntw", "o\n\nthree\n") == "[rank1]: one\n[rank1]: two\n\n[rank1]: three\n"


def test_a_progress_bar_is_redrawn_in_place_with_its_prefix():
    followed = _Followed("unused", "stderr", "[rank0]: ", {})
    # tqdm writes a carriage return, then the bar; the last refresh ends the line
    out = lines_of(followed, "\r 0%|", "   | 0/2", "\r 50%|#  | 1/2", "\r100%|## | 2/2", "\n")
    assert out == "\r[rank0]:  0%|   | 0/2\r[rank0]:  50%|#  | 1/2\r[rank0]: 100%|## | 2/2\n"


def test_an_unfinished_line_waits_for_its_end_unless_it_waits_too_long():
    followed = _Followed("unused", "stdout", "[rank0]: ", {})
    assert followed._lines("epoch 1 ...", False, now=10.0) == ""  # held: another rank's line may come first
    assert followed._lines("", False, now=10.0 + PARTIAL_LINE_SECONDS / 2) == ""
    assert followed._lines(" done\n", False, now=10.6) == "[rank0]: epoch 1 ... done\n"
    assert followed._lines("waiting", False, now=20.0) == ""
    assert followed._lines("", False, now=20.0 + PARTIAL_LINE_SECONDS) == "[rank0]: waiting"
    assert followed._lines(" and on\n", False, now=30.0) == " and on\n"
    # what is left open at the end is copied, and the next writer starts on a line of its own
    assert lines_of(followed, "no newline at the end") == "[rank0]: no newline at the end\n"


def test_a_line_torch_already_named_is_not_prefixed_twice():
    followed = _Followed("unused", "stderr", "[rank1]: ", {})
    out = lines_of(followed, "[rank1]: Traceback (most recent call last):\n[rank1]:   File ...\nmine\n")
    assert out == "[rank1]: Traceback (most recent call last):\n[rank1]:   File ...\n[rank1]: mine\n"
    # another rank's name is kept and this one's added
    assert lines_of(_Followed("unused", "stderr", "[rank0]: ", {}), "[rank1]: x\n") == "[rank0]: [rank1]: x\n"


def test_another_rank_s_line_starts_below_an_open_bar(tmp_path, capsys):
    console: dict = {}
    bar, other = (tmp_path / "bar.log"), (tmp_path / "other.log")
    bar_copy = _Followed(str(bar), "stderr", "[rank0]: ", console)
    other_copy = _Followed(str(other), "stderr", "[rank1]: ", console)
    bar.write_text("\r 10%")
    other.write_text("")
    bar_copy.pump()
    other.write_text("a line\n")
    other_copy.pump()
    bar.write_text("\r 10%\r 20%")
    bar_copy.pump()
    for followed in (bar_copy, other_copy):
        followed.pump(final=True)
        followed.close()
    assert capsys.readouterr().err == "\r[rank0]:  10%\n[rank1]: a line\n\r[rank0]:  20%\n"


def test_without_a_prefix_lines_are_copied_as_they_are():
    followed = _Followed("unused", "stdout", "", {})
    assert lines_of(followed, "one\n\rbar 1\rbar 2", "\n", "open") == "one\n\rbar 1\rbar 2\nopen\n"


def test_the_copy_reads_files_that_appear_late_and_bytes_split_inside_a_character(tmp_path, capsys):
    copy = ConsoleCopy(interval_seconds=3600)  # the thread sleeps: only finish() copies, so the test decides when
    path = tmp_path / "late.log"
    copy.follow(str(path), "stdout", "[rank0]: ")
    data = "naïve ✓\n".encode()
    with open(path, "wb") as handle:
        handle.write(data[:3])  # the first byte of "ï" only
        handle.flush()
        with copy._lock:  # as the copy's own thread pumps (its first round may run now): one pump at a time
            copy._files[0].pump()
        handle.write(data[3:])
    copy.close()
    assert capsys.readouterr().out == "[rank0]: naïve ✓\n"


# --- what a launch does with the output ------------------------------------------------------------------


def test_the_defaults_prefix_only_with_more_than_one_process_and_keep_no_files():
    one = WorkerOutput(world_size=1)
    assert not one.rank_prefix and one.passthrough  # the worker writes to the console itself, as python would
    two = WorkerOutput(world_size=2)
    assert two.rank_prefix and not two.passthrough and two.log_dir is None
    assert WorkerOutput(world_size=2, rank_prefix=False).passthrough
    assert not WorkerOutput(world_size=2, rank_prefix=False, show_ranks=[0]).passthrough
    assert WorkerOutput(world_size=1, rank_prefix=True).rank_prefix


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"show_ranks": [2]}, ValueError, r"show_ranks: 2 is not a rank of this launch; its ranks are 0 … 1"),
        ({"show_ranks": []}, ValueError, "show_ranks: expected at least one rank"),
        ({"show_ranks": [True]}, ValueError, "show_ranks: True is not a rank"),
        ({"rank_prefix": "yes"}, TypeError, "rank_prefix: expected True, False or None"),
    ],
)
def test_bad_output_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        WorkerOutput(world_size=2, **kwargs)


def test_a_log_dir_that_is_a_file_is_refused_before_anything_starts(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("open('ran', 'w').close()\n")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"log_dir: '.*file' is a file; expected a folder"):
        launch(str(script), nproc_per_node=2, log_dir=str(tmp_path / "file"))
    assert not (tmp_path / "ran").exists()


def test_the_failure_summary_says_where_the_output_of_a_hidden_rank_is(tmp_path):
    output = WorkerOutput(world_size=4, show_ranks=[0])
    assert output.where([0]) == "each worker's own output is above"
    assert output.where([0, 2, 3]) == (
        "the output of rank(s) 2, 3 was not shown (show_ranks=0); log_dir=DIR keeps every rank's"
    )
    kept = WorkerOutput(world_size=4, show_ranks=[0], log_dir=tmp_path)
    kept.attempt_dir = str(tmp_path / "dpkit_x" / "attempt_0")
    assert kept.where([1]) == f"the output of rank(s) 1 is in {kept.attempt_dir}, not above (show_ranks=0)"
    assert kept.where([0]) == f"each worker's own output is above, and in {kept.attempt_dir}"


TALKS = textwrap.dedent("""
    import os, sys, time
    rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"out {rank} attempt {attempt}")
    print(f"err {rank} attempt {attempt}", file=sys.stderr)
    # a progress bar's three refreshes and its end, in one write: no other rank's line can come between them
    sys.stderr.write("".join(f"\\rbar {rank} {step}" for step in range(3)) + "\\n")
    said = os.path.join(sys.argv[2], f"said-{rank}-{attempt}")
    open(said, "w").close()
    if sys.argv[1] == "rank-1-fails" and rank == "1":
        while not os.path.exists(os.path.join(sys.argv[2], f"said-0-{attempt}")):
            time.sleep(0.01)  # rank 0 has said everything before this failure stops it
        sys.exit(6)
""")


def test_each_console_line_names_its_rank_and_the_scratch_files_are_removed(tmp_path, capsys, monkeypatch):
    import tempfile

    made = []
    real_mkdtemp = tempfile.mkdtemp

    def recorded_mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recorded_mkdtemp)
    script = tmp_path / "talks.py"
    script.write_text(TALKS)
    launch(str(script), ["ok", str(tmp_path)], nproc_per_node=2)
    captured = capsys.readouterr()
    assert sorted(captured.out.splitlines()) == ["[rank0]: out 0 attempt 0", "[rank1]: out 1 attempt 0"]
    # the bar is one line, redrawn in place with its prefix after each carriage return, not a line per refresh
    assert sorted(captured.err.split("\n")) == sorted(
        [
            "",
            "[rank0]: err 0 attempt 0",
            "[rank1]: err 1 attempt 0",
            "\r[rank0]: bar 0 0\r[rank0]: bar 0 1\r[rank0]: bar 0 2",
            "\r[rank1]: bar 1 0\r[rank1]: bar 1 1\r[rank1]: bar 1 2",
        ]
    ), captured.err
    assert [path for path in made if "dpkit-launch-" in path] and not any(os.path.exists(path) for path in made)


def test_log_dir_keeps_every_attempt_of_every_rank_and_a_hidden_rank_s_failure_points_there(tmp_path, capsys):
    script = tmp_path / "talks.py"
    script.write_text(TALKS)
    logs = tmp_path / "logs"
    with pytest.raises(LaunchError) as error:
        launch(
            str(script),
            ["rank-1-fails", str(tmp_path)],
            nproc_per_node=2,
            max_restarts=1,
            log_dir=str(logs),
            show_ranks=[0],
        )
    (run,) = logs.iterdir()
    assert re.fullmatch(r"dpkit_\w+", run.name)
    for attempt in (0, 1):
        for rank in (0, 1):
            folder = run / f"attempt_{attempt}" / str(rank)
            assert (folder / "stdout.log").read_bytes() == f"out {rank} attempt {attempt}\n".encode()  # no prefix
            bar = "".join(f"\rbar {rank} {step}" for step in range(3))
            assert (folder / "stderr.log").read_bytes() == f"err {rank} attempt {attempt}\n{bar}\n".encode()
    # the console: rank 0 of both attempts, never rank 1; the summary says where rank 1's output is
    assert capsys.readouterr().out.splitlines() == ["[rank0]: out 0 attempt 0", "[rank0]: out 0 attempt 1"]
    assert re.fullmatch(
        rf"worker rank 1 \(local rank 1, pid \d+\) exited with code 6(; the launcher then stopped worker rank\(s\) 0)? "
        rf"\(the output of rank\(s\) 1 is in "
        rf"{re.escape(str(run / 'attempt_1'))}, not above \(show_ranks=0\)\)",
        str(error.value),
    ), str(error.value)


def test_a_relaunched_command_s_workers_write_without_prefixes(monkeypatch):

    import dpkit.launch.agent
    from dpkit.launch import Command, relaunch

    calls = []
    monkeypatch.setattr(dpkit.launch.agent, "launch", lambda *args, **kwargs: calls.append(kwargs))
    relaunch(Command("dpkit.cli.main", ("train",)), 2, max_restarts=1)
    relaunch(Command("dpkit.cli.main", ("train",)), 2, rank_prefix=True, log_dir="logs")
    assert calls[0]["rank_prefix"] is False and calls[0]["max_restarts"] == 1
    assert calls[1]["rank_prefix"] is True and calls[1]["log_dir"] == "logs"  # a caller may still ask for them
