"""The client reads which directory process answered from the ResponseHeader, and from the deprecated field of a
directory that predates the header."""

from __future__ import annotations

from kvpush.client import incarnation_of
from kvpush.v1 import directory_pb2 as dpb


def test_the_header_is_read_first():
    """A response with both names the header's incarnation."""
    response = dpb.RenewLeaseResponse(header=dpb.ResponseHeader(directory_incarnation_id="new"),
                                      directory_incarnation_id="old")
    assert incarnation_of(response) == "new"


def test_a_directory_without_the_header_is_read_from_the_deprecated_field():
    """An older directory fills only directory_incarnation_id: the client still sees its incarnation."""
    assert incarnation_of(dpb.WatchTransfersResponse(directory_incarnation_id="old")) == "old"
    assert incarnation_of(dpb.RegisterEngineResponse()) == ""
