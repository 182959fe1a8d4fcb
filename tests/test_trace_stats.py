"""The routing statistics on hand-built traces with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.traces import stats as ts
from eldr_sglang.traces import Trace


def _trace(rows_per_req, prefill, ids, E, domain=None):
    ids = np.asarray(ids, dtype=np.int16)
    off = np.concatenate([[0], np.cumsum(rows_per_req)]).astype(np.int64)
    return Trace(expert_ids=ids, req_offsets=off, prefill_len=np.asarray(prefill, dtype=np.int32),
                 meta={"num_layers": ids.shape[1], "num_experts": E, "top_k": ids.shape[2]},
                 domain=None if domain is None else np.asarray(domain))


def test_entropy_of_uniform_and_of_a_single_expert():
    # layer 0 spreads picks evenly over 4 experts, layer 1 always picks expert 2 (k=1)
    ids = [[[e], [2]] for e in (0, 1, 2, 3)]
    t = _trace([4], [2], ids, E=4)
    np.testing.assert_allclose(ts.layer_entropy(t), [2.0, 0.0])
    np.testing.assert_allclose(ts.request_entropy(t), [2.0, 0.0])


def test_mutual_information_perfect_and_none():
    # two domains of equal weight: domain a always uses expert 0, domain b expert 1 (layer 0);
    # at layer 1 both use experts 0 and 1 equally
    ids = [[[0], [0]], [[0], [1]], [[1], [0]], [[1], [1]]]
    t = _trace([2, 2], [1, 1], ids, E=2, domain=["a", "b"])
    np.testing.assert_allclose(ts.domain_mutual_information(t), [1.0, 0.0], atol=1e-12)


def test_hit_rate_counts_decode_picks_in_the_prefill_set():
    # request 0: prefill picks {0,1}; decode picks 1 (hit), 2 (miss)
    # request 1: prefill picks {2,3}; decode picks 3 (hit), 3 (hit)
    t = _trace([2, 2], [1, 1], [[[0, 1]], [[1, 2]], [[2, 3]], [[3, 2]]], E=4)
    np.testing.assert_allclose(ts.prefill_decode_hit_rate(t), [3 / 4])
    # swapped pairing: request 0's decode {1,2} against {2,3}; request 1's {3,2} against {0,1}
    np.testing.assert_allclose(ts.prefill_decode_hit_rate(t, np.array([1, 0])), [1 / 4])


def test_hit_rate_skips_requests_without_prefill():
    t = _trace([2, 2], [0, 1], [[[0]], [[0]], [[1]], [[1]]], E=2)
    np.testing.assert_allclose(ts.prefill_decode_hit_rate(t), [1.0])


def test_shuffled_pairing_never_pairs_a_request_with_itself():
    t = _trace([1] * 50, [1] * 50, [[[0]]] * 50, E=2)
    p = ts.shuffled_pairing(t, seed=3)
    assert np.all(p != np.arange(50)) and p.min() >= 0 and p.max() < 50


def test_errors_name_the_problem():
    t = _trace([2], [1], [[[0]], [[1]]], E=2)
    with pytest.raises(ValueError, match="no domain labels"):
        ts.domain_mutual_information(t)
    with pytest.raises(ValueError, match="phase"):
        ts.layer_entropy(t, phase="middle")
