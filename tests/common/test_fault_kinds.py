"""Fault classification (common/fault_kinds.py): real log excerpts from public
issues classify as the kind a person reading them would name, in the table's order."""

from __future__ import annotations

import pathlib
import re

import pytest

from common.fault_kinds import (
    ACTIONS,
    FAULT_KINDS,
    RULES,
    TRANSIENT_KINDS,
    classify,
    evidence_line,
    top_frame,
    torchrun_root_cause,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = sorted((ROOT / "tests" / "fixtures" / "fault_logs").glob("*.log"))
DOC = (ROOT / "docs" / "faults.md").read_text()
TORCHRUN_EXIT = 1  # torchrun's own exit code, whatever its ranks' was (activities/supervise.py)


def _fixture(name: str) -> tuple[dict[str, str], list[str]]:
    """The `# key: value` header lines, and the excerpt after them."""
    lines = (ROOT / "tests" / "fixtures" / "fault_logs" / name).read_text().splitlines()
    head: dict[str, str] = {}
    while lines and lines[0].startswith("# "):
        key, _, value = lines.pop(0)[2:].partition(": ")
        head[key] = value
    return head, lines


def _as_the_supervisor_sees_it(name: str) -> str:
    """classify() called the way activities/supervise.py calls it: the root-cause rank's
    exit code from torchrun's summary when there is one, else the process's own."""
    head, lines = _fixture(name)
    _, rank_code = torchrun_root_cause("\n".join(lines))
    code = rank_code if rank_code is not None else int(head.get("exit_code", TORCHRUN_EXIT))
    return classify(code, head.get("error_type", ""), lines)


@pytest.mark.parametrize("name", [p.name for p in FIXTURES])
def test_each_real_log_excerpt_is_classified_as_its_kind(name):
    head, _ = _fixture(name)
    assert _as_the_supervisor_sees_it(name) == head["expected"]


@pytest.mark.parametrize("name", [p.name for p in FIXTURES])
def test_each_excerpt_names_its_public_source_and_a_known_kind(name):
    head, lines = _fixture(name)
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+", head["source"])
    assert head["expected"] in FAULT_KINDS
    assert 4 <= len(lines) <= 40 and any(line.strip() for line in lines)


def test_the_excerpts_cover_every_kind_a_log_can_show():
    seen = {_fixture(p.name)[0]["expected"] for p in FIXTURES}
    assert len(FIXTURES) >= 12
    assert seen == {"oom", "ecc", "cuda", "nccl", "rank_lost", "crash", "preempted"}


# ---- the order of the rules ----------------------------------------------------------
OOM = "RuntimeError: CUDA out of memory. Tried to allocate 86.00 MiB (GPU 3; 11.75 GiB total"
RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error "
         "[192.168.70.92]:25266: Connection reset by peer")


def test_a_hang_outranks_every_other_evidence():
    assert classify(-9, "StorageUnavailable", [OOM], hung=True, oom_kills=2) == "hang"


def test_a_storage_outage_outranks_an_oom_kill_and_the_log():
    assert classify(4, "StorageUnavailable", [OOM], oom_kills=1) == "storage_outage"


def test_the_kernels_oom_killer_outranks_the_sigkill_it_sent_and_the_peers_resets():
    assert classify(-9, "", [RESET]) == "rank_lost"
    assert classify(-9, "", [RESET], oom_kills=1) == "oom"


@pytest.mark.parametrize("error_type", ["OutOfMemoryError", "torch.OutOfMemoryError",
                                        "MemoryError"])
def test_an_out_of_memory_error_type_is_oom_whatever_the_log_says(error_type):
    _, watchdog = _fixture("nccl_watchdog_timeout.log")
    assert classify(1, error_type, watchdog) == "oom"


def test_a_cpu_allocation_failure_in_the_message_is_oom():
    message = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
               "allocate memory: you tried to allocate 314572800 bytes. Error code 12 "
               "(Cannot allocate memory)")
    assert classify(1, "RuntimeError", (), message=message) == "oom"
    assert classify(1, "RuntimeError", ()) == "crash"


def test_the_message_is_read_before_the_log_lines():
    _, watchdog = _fixture("nccl_watchdog_timeout.log")
    assert classify(1, "RuntimeError", watchdog) == "nccl"
    assert classify(1, "RuntimeError", watchdog,
                    message="CUDA error: an illegal memory access was encountered") == "cuda"


def test_the_earliest_evidence_wins_so_a_cuda_oom_beats_the_watchdog_timeouts_it_caused():
    _, lines = _fixture("cuda_oom_then_watchdog_timeouts_on_other_ranks.log")
    after = lines[lines.index(next(x for x in lines if "closing signal SIGTERM" in x)) + 1:]
    assert classify(1, "", lines) == "oom"
    assert classify(1, "", after) == "nccl"  # the follow-on noise alone
    assert classify(1, "", list(reversed(lines))) == "nccl"  # read newest first, it would win


def test_within_one_line_ecc_beats_cuda_and_cuda_beats_the_watchdog_that_rethrows_it():
    assert classify(1, "", ["RuntimeError: CUDA error: uncorrectable ECC error encountered"]) \
        == "ecc"
    assert classify(-6, "", ["[rank0]:[E ProcessGroupNCCL.cpp:1414] [PG 2 Rank 0] Process group "
                             "watchdog thread terminated with exception: CUDA error: an illegal "
                             "memory access was encountered"]) == "cuda"


def test_the_log_outranks_the_sigabrt_of_a_watchdog_that_takes_the_process_down():
    _, lines = _fixture("nccl_watchdog_takes_the_process_down.log")
    assert classify(-6, "", lines) == "nccl"
    assert classify(-6, "", []) == "rank_lost"


def test_sigterm_is_a_preemption_and_other_signals_a_lost_rank():
    assert classify(-15) == "preempted"
    assert [classify(code) for code in (-9, -11, -6, -64)] == ["rank_lost"] * 4
    assert classify(1) == classify(None) == classify(0) == "crash"


def test_torchrun_closing_the_other_ranks_with_sigterm_is_not_a_preemption():
    _, lines = _fixture("rank_exits_1_and_torchrun_sigterms_the_rest.log")
    assert classify(1, "", lines) == "crash"


def test_a_peers_reset_connection_is_a_lost_rank_below_the_signals():
    assert classify(1, "", [RESET]) == "rank_lost"
    assert classify(-15, "", [RESET]) == "preempted"  # the survivors' view of a preemption
    _, remote = _fixture("nccl_remote_error_network.log")  # NCCL's error names no culprit
    assert classify(1, "", remote) == "nccl"


def test_the_rule_table_is_total_and_names_only_known_kinds():
    assert {rule.kind for rule in RULES} <= set(FAULT_KINDS)
    last = RULES[-1]
    assert last.kind == "crash" and last.text is None and not last.error_types
    assert evidence_line("", ["loss 2.31", "step 12"]) == ""


# ---- top_frame -----------------------------------------------------------------------
def test_top_frame_is_the_innermost_frame_of_the_traceback():
    assert top_frame(_fixture("python_exception_in_training_loop.log")[1]) \
        == "functional.py:1869 in nll_loss"
    assert top_frame(_fixture("cuda_oom_in_backward.log")[1]) == "__init__.py:93 in backward"


def test_top_frame_takes_the_last_traceback_and_passes_over_torchruns_own():
    crash = _fixture("python_exception_in_training_loop.log")[1]
    oom = _fixture("cuda_oom_in_backward.log")[1]
    summary = ["Traceback (most recent call last):"] + _fixture("torchrun_rank_sigkill.log")[1]
    assert top_frame(crash + oom) == "__init__.py:93 in backward"
    assert top_frame(crash + summary) == "functional.py:1869 in nll_loss"
    assert top_frame(summary) == ""


def test_top_frame_reads_rank_prefixes_and_windows_paths_and_is_empty_without_a_traceback():
    assert top_frame(["[rank7]: Traceback (most recent call last):",
                      '[rank7]:   File "/mnt/code/scripts/train_wan2_1_tim.py", line 1001, '
                      'in <module>', "[rank7]:     app.run(main)",
                      "[rank7]: KeyError: 0"]) == "train_wan2_1_tim.py:1001 in <module>"
    assert top_frame(["Traceback (most recent call last):",
                      '  File "D:\\Anaconda\\envs\\x\\lib\\site-packages\\torch\\autograd\\'
                      '__init__.py", line 276, in grad', "RuntimeError: CUDA out of memory"]) \
        == "__init__.py:276 in grad"
    assert top_frame(_fixture("nccl_watchdog_timeout.log")[1]) == ""
    assert top_frame([]) == ""


# ---- torchrun's summary --------------------------------------------------------------
def test_torchrun_root_cause_reads_the_first_failure_not_the_other_failures():
    assert torchrun_root_cause("\n".join(_fixture("torchrun_rank_sigkill.log")[1])) == (0, -9)
    assert torchrun_root_cause("\n".join(_fixture("torchrun_summary_rank_exit_1.log")[1])) \
        == (0, 1)
    assert torchrun_root_cause("\n".join(_fixture("torchrun_gets_sigterm.log")[1])) \
        == (None, None)


# ---- the kinds, what is done about them, docs/faults.md ------------------------------
def test_transient_kinds_are_fault_kinds_and_actions_cover_exactly_the_kinds():
    assert TRANSIENT_KINDS == {"worker_lost", "storage_outage", "preempted", "server_unavailable"}
    assert TRANSIENT_KINDS < set(FAULT_KINDS)
    assert set(ACTIONS) == set(FAULT_KINDS)
    assert all(text and ". " not in text and not text.endswith(".") for text in ACTIONS.values())


def _doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 5:
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_fault_kind_is_in_the_docs_table_as_the_code_says():
    rows = _doc_rows()
    assert set(rows) == set(FAULT_KINDS)
    for kind, (_, means, _seen, does, counts) in rows.items():
        assert means == FAULT_KINDS[kind], kind
        assert does == ACTIONS[kind], kind
        assert counts == ("no" if kind in TRANSIENT_KINDS else "yes"), kind


def test_the_docs_list_the_rules_in_the_tables_order():
    at = [DOC.find(f"{i}. `{rule.kind}`: {rule.why}") for i, rule in enumerate(RULES, 1)]
    assert -1 not in at and at == sorted(at)


@pytest.mark.parametrize("name", [p.name for p in FIXTURES])
def test_the_docs_list_each_excerpt_with_its_source_and_kind(name):
    head, _ = _fixture(name)
    assert f"| `{name}` | {head['source']} | `{head['expected']}` |" in DOC


def test_only_a_rank_that_lost_its_peer_is_a_peer_failure_for_the_gangs_blame():
    from common.fault_kinds import lost_a_peer

    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [10.1.0.3]:41817")
    assert classify(1, "RuntimeError", [gloo], False) == "rank_lost"
    assert lost_a_peer("rank_lost", None, gloo)
    assert lost_a_peer("nccl", None, "Watchdog caught collective operation timeout")
    assert not lost_a_peer("rank_lost", "SIGKILL", "")  # its own rank was killed
    assert not lost_a_peer("rank_lost", None, "rank 1 died; torchrun was stopping the others")
    assert not lost_a_peer("crash", None, "RuntimeError: injected crash at step 7")
