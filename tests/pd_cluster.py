"""Deprecated alias: the loopback cluster helpers live in `eldr_sglang.testing.pd_cluster`."""

from eldr_sglang.testing.pd_cluster import *  # noqa: F401,F403
