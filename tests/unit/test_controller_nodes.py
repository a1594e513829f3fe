"""The canary's window counted node by node: a node whose metrics were not read at both ends of a
step's window (or that was up at only one of them) never lets the step pass on the other nodes'
figures (serving.control.watch, serving.control.canary), with a recording applier and a fake
clock as in test_controller.py."""

from __future__ import annotations

from pathlib import Path

from serving.control.controller import Controller
from serving.control.watch import Scrape, VersionStats, scrape, scrape_from_json, scrape_json, shift, unseen, window
from tests.unit.test_controller import Clock, Cluster, _cfg, _controller, _publish, _run


class LateNode(Cluster):
    """A second node whose metrics agent answers only once the canary takes traffic, with totals
    from before the promotion: 10,000 requests of v1, half of them failed."""

    def metrics_by_node(self) -> dict[str, str | None]:
        texts: dict[str, str | None] = {**super().metrics_by_node(), "node-2": None}
        if any(v == "v2" and w > 0 for v, w in self.weights()):
            lab = 'model="calc",version="v1"'
            texts["node-2"] = "\n".join(
                [
                    f'ray_raystack_requests_total{{{lab},status_class="2xx"}} 5000',
                    f'ray_raystack_requests_total{{{lab},status_class="5xx"}} 5000',
                    f'ray_raystack_time_to_first_token_seconds_bucket{{{lab},le="0.05"}} 10000',
                    f'ray_raystack_time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} 10000',
                ]
            )
        return texts


def test_a_node_not_read_at_the_steps_start_is_left_out_of_its_window(tmp_path: Path) -> None:
    """The new version fails 30% of its requests, the live one none. A node whose scrape failed
    when the step began must not bring its totals since it started into the step's window: they
    would make the live version look 50% failed and the canary pass its first step."""
    (tmp_path / "ck").mkdir()
    clock = Clock()
    cluster = LateNode(clock)
    ctl = _controller(tmp_path, _cfg(), clock, cluster)
    _publish(tmp_path / "ck", "calc", "v2")
    cluster.per_tick = {"v1": (10, 0, 0.05), "v2": (10, 3, 0.05)}
    _run(ctl, clock, 25)
    (rec,) = ctl.control.history("calc")
    assert rec.status == "rolled_back" and rec.reason.startswith("at 10%: error rate"), rec.reason
    assert [s.phase for s in rec.steps].count("passed") == 0
    assert cluster.weights() == [("v1", 100)]


class SecondNode(Cluster):
    """Two nodes: node-1 as Cluster scripts it (both versions clean), node-2 with its own gateway
    replica, scripted by ``other``. node-2's metrics agent does not answer while ``down``."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.other = Cluster(clock)
        self.down = False

    def metrics_by_node(self) -> dict[str, str | None]:
        (text,) = self.other.metrics_by_node().values()  # its counters go on whether read or not
        return {**super().metrics_by_node(), "node-2": None if self.down else text}


def _canary(tmp_path: Path, down: bool, node_2_fails: bool) -> tuple[Controller, SecondNode]:
    """A controller over two nodes with calc@v2 just published; node-2 fails half of v2's
    requests if ``node_2_fails``."""
    clock = Clock()
    cluster = SecondNode(clock)
    cluster.down = down
    cluster.other.per_tick = {"v1": (10, 0, 0.05), "v2": (10, 5 if node_2_fails else 0, 0.05)}
    (tmp_path / "ck").mkdir()
    ctl = _controller(tmp_path, _cfg(), clock, cluster)
    _publish(tmp_path / "ck", "calc", "v2")
    return ctl, cluster


def test_a_node_not_read_when_the_step_is_judged_makes_it_watched_again_not_passed(tmp_path: Path) -> None:
    """node-1 alone would pass the canary's first step; the failures are on node-2, whose agent
    does not answer at the step's start or when it is judged. The step is watched again from a
    fresh scrape, and the first window read on both nodes rolls the canary back."""
    ctl, cluster = _canary(tmp_path, True, node_2_fails=True)
    for _ in range(40):
        _run(ctl, cluster.clock, 1)
        (rec,) = ctl.control.history("calc")
        if cluster.down and any(s.phase == "extend" for s in rec.steps):
            cluster.down = False
    extends = [s for s in rec.steps if s.phase == "extend"]
    assert extends and "metrics of node node-2 not read at both ends of the window" in extends[0].note
    assert extends[0].figures["nodes_not_counted"] == 1
    assert [s.phase for s in rec.steps].count("passed") == 0
    assert rec.status == "rolled_back" and rec.reason.startswith("at 10%: error rate"), rec.reason
    assert cluster.weights() == [("v1", 100)]


def test_a_node_never_read_rolls_the_canary_back_after_the_extensions(tmp_path: Path) -> None:
    """Both versions clean on node-1, node-2 never answers: nothing is known of its traffic, so
    the canary is not promoted on node-1's figures; it is rolled back, naming the node."""
    ctl, cluster = _canary(tmp_path, True, node_2_fails=False)
    _run(ctl, cluster.clock, 40)
    (rec,) = ctl.control.history("calc")
    assert [s.phase for s in rec.steps].count("extend") == 2  # max_step_extensions
    assert rec.status == "rolled_back", rec.status
    assert rec.reason == "at 10%: metrics of node node-2 not read at both ends of the window, after 2 extensions"
    assert cluster.weights() == [("v1", 100)]


def test_both_nodes_read_the_canary_is_promoted(tmp_path: Path) -> None:
    ctl, cluster = _canary(tmp_path, False, node_2_fails=False)
    _run(ctl, cluster.clock, 40)
    (rec,) = ctl.control.history("calc")
    assert rec.status == "promoted" and "extend" not in [s.phase for s in rec.steps]


def _stats(requests: float) -> dict[str, VersionStats]:
    return {"v2": VersionStats(requests=requests)}


def test_unseen_names_nodes_unread_at_an_end_or_up_at_only_one() -> None:
    start = Scrape({"a": _stats(1), "b": _stats(1), "gone": _stats(1)}, frozenset({"c"}))
    now = Scrape({"a": _stats(5), "c": _stats(9), "new": _stats(2)}, frozenset({"b"}))
    assert list(unseen(now, start)) == ["b", "c", "gone", "new"]
    assert window(now, start) == {"v2": VersionStats(requests=4)}  # a alone
    assert list(unseen(now, Scrape({"a": _stats(1)}))) == ["b", "c", "new"]
    assert unseen(Scrape({"a": _stats(2)}), Scrape({"a": _stats(1)})) == {}
    # a node whose counts went back (whatever restarted there) cannot be counted either
    went_back = unseen(Scrape({"a": _stats(2)}), Scrape({"a": _stats(5)}))
    assert went_back == {"a": "counted less at the window's end than at its start"}
    assert window(Scrape({"a": _stats(2)}), Scrape({"a": _stats(5)})) == {"v2": VersionStats()}


def test_unread_nodes_survive_the_record_and_the_evals_shift() -> None:
    start = scrape({"a": 'ray_raystack_requests_total{model="m",version="v2",status_class="2xx"} 3', "b": None}, "m")
    assert start.unread == {"b"} and start.nodes["a"]["v2"].requests == 3
    assert scrape_from_json(scrape_json(start)) == start
    assert scrape_from_json({"nodes": {}}) == Scrape()  # a record written before unread nodes were kept
    # a node read at the start but not while the eval ran is unread in the shifted baseline
    shifted = shift(start, Scrape({"a": _stats(3)}, frozenset({"c"})), Scrape({"a": _stats(5), "c": _stats(1)}))
    assert shifted.unread == {"b", "c"} and set(shifted.nodes) == {"a"}
