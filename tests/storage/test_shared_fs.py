"""One S3 filesystem per process, endpoint and credentials (storage/fs.py `resolve`): a new
s3fs instance costs a botocore session and client before its first answer."""

from __future__ import annotations

import os
import threading

from storage.fs import resolve


def test_every_thread_of_a_process_shares_one_s3_filesystem_and_it_answers_each(s3_env, seaweed):
    fs, root = resolve(f"s3://{seaweed.bucket}/shared")
    fs.pipe(f"{root}/a.json", b"{}")
    seen: list = []

    def other_thread() -> None:
        other, path = resolve(f"s3://{seaweed.bucket}/shared/a.json")
        seen.append((other, other.cat(path)))
    th = threading.Thread(target=other_thread)
    th.start()
    th.join()
    assert seen[0][0] is fs and seen[0][1] == b"{}"
    assert root.endswith("/shared") and "://" not in root


def test_a_forked_child_and_other_credentials_get_a_filesystem_of_their_own(s3_env, seaweed, monkeypatch):
    fs, root = resolve(f"s3://{seaweed.bucket}/own")
    fs.pipe(f"{root}/b.json", b"[1]")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's instance is bound to an IO loop it lacks
        try:
            child, path = resolve(f"s3://{seaweed.bucket}/own/b.json")
            ok = child is not fs and child.cat(path) == b"[1]"
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")
    assert resolve(f"s3://{seaweed.bucket}/own")[0] is not fs


def test_the_s3_endpoint_variable_of_its_own_is_honoured_before_the_global_one(s3_env, seaweed,
                                                                               monkeypatch):
    # botocore's order: AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL; with only the S3 one
    # set, the store still reaches SeaweedFS with the S3-compatible client settings.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", seaweed.endpoint)
    from storage.fs import s3_options

    opts = s3_options()
    assert opts["client_kwargs"] == {"endpoint_url": seaweed.endpoint}
    assert opts["config_kwargs"]["request_checksum_calculation"] == "when_required"
    fs, root = resolve(f"s3://{seaweed.bucket}/endpoint-s3")
    fs.pipe(f"{root}/c.json", b"[2]")
    assert fs.cat(f"{root}/c.json") == b"[2]"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the global one: not used
    assert s3_options()["client_kwargs"] == {"endpoint_url": seaweed.endpoint}
    monkeypatch.setenv("MAINSPRING_S3_ENDPOINT", "http://127.0.0.1:8")  # ours comes first
    assert s3_options()["client_kwargs"] == {"endpoint_url": "http://127.0.0.1:8"}
