"""Which storage errors mean 'retry later' (storage.fs.is_unavailable), for the errors s3fs
really raises: botocore's ClientError for an HTTP status, through s3fs's own translation."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from s3fs.errors import translate_boto_error

from storage.fs import is_unavailable


def s3_error(status: int, code: str) -> BaseException:
    err = ClientError({"Error": {"Code": code, "Message": f"{code} from the gateway"},
                       "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    return translate_boto_error(err)


@pytest.mark.parametrize("status,code", [(500, "InternalError"), (503, "SlowDown"),
                                         (503, "ServiceUnavailable")])
def test_server_side_s3_errors_are_an_outage_to_wait_out(status, code):
    assert is_unavailable(s3_error(status, code))


@pytest.mark.parametrize("status,code", [(403, "AccessDenied"), (400, "InvalidArgument"),
                                         (404, "NoSuchBucket")])
def test_client_side_s3_errors_need_a_human_not_a_retry(status, code):
    assert not is_unavailable(s3_error(status, code))


def test_unreachable_endpoint_and_full_disk_are_told_apart():
    assert is_unavailable(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert not is_unavailable(OSError(errno.ENOSPC, "No space left on device"))
