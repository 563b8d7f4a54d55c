"""Known, open bugs that end-to-end tests currently hit, as non-strict xfail markers.

Each marker names the bug so the test summary shows it on every run; a test that passes anyway is
reported as XPASS. Remove a marker as soon as its bug is fixed (the issue tracker has the details).
"""

import pytest

# Prefill worker freezes for up to ~60 s right after its first push instruction: the py-spy dump shows the
# data plane's I/O thread inside nixl add_remote_agent (loading the decode peer) while the rest of the
# process (forward thread, directory stream, lease renewals) stands still. The push then times out and
# decode recomputes (tokens still equal colocated) or the prefill lease lapses and the transfer FAILs.
PREFILL_PEER_LOAD_FREEZE = pytest.mark.xfail(
    strict=False,
    reason="open bug: prefill worker freezes while NIXL loads the decode peer (add_remote_agent); "
           "pushes time out on this machine (issue 4)",
)
