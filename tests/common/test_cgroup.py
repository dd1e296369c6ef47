"""Reading the kernel OOM killer's count for a process's memory cgroup (common/cgroup.py)."""

from __future__ import annotations

from common.cgroup import memory_cgroup_files, oom_kill_count, parse_oom_kills


def test_v1_and_v2_cgroup_lines_name_their_oom_files():
    files = memory_cgroup_files("4:memory:/job/a\n0::/user.slice/x\n3:cpu:/y", root="/cg")
    assert "/cg/memory/job/a/memory.oom_control" in files
    assert "/cg/user.slice/x/memory.events" in files
    assert not any("/cpu/" in f for f in files)


def test_the_oom_kill_count_is_read_from_either_format():
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3  # v1
    assert parse_oom_kills("low 0\nhigh 0\nmax 2\noom 2\noom_kill 1\n") == 1  # v2
    assert parse_oom_kills("oom 2\n") is None


def test_this_process_count_is_a_number_or_unknown():
    count = oom_kill_count()
    assert count is None or count >= 0
