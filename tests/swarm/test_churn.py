"""`peer swarm --churn`: each step's share of kills lands even when the launcher sees the run's
version rarely (steps passed unseen, a run over between two looks). The process side (SIGKILL, a
replacement) is exercised for real by tests/swarm/test_faults.py::test_random_churn_equals_the_reference;
here the swarm's volunteers are a table, so that the counts and times are exact."""

import asyncio
import random

import pytest

from peer.launcher.churn import Churn


class Table:
    """The volunteers of a swarm, as `Swarm` keeps them: a kill replaces the volunteer under its name."""

    def __init__(self, n: int):
        self.volunteers = {f"v{i}": i for i in range(n)}
        self.kills: list[str] = []

    def kill_volunteer(self, name: str) -> None:
        self.kills.append(name)
        self.volunteers[name] = len(self.kills) + 100


def run(scenario):
    async def main():
        table = Table(4)
        churn = Churn(table, 0.5, random.Random(0))
        await scenario(churn)
        return table, churn

    return asyncio.run(main())


def test_kills_land_on_their_timers_between_the_launchers_looks():
    async def scenario(churn):
        churn.steps_began(1, within=0.05)  # the first step, as soon as every server is up
        await asyncio.sleep(0.2)  # no look at the run in between (the old launcher killed only when it looked)

    table, churn = run(scenario)
    assert len(table.kills) == 2 and len(set(table.kills)) == 2  # half of 4, two different volunteers
    assert churn.pending == {}


def test_steps_passed_unseen_get_their_share_and_a_step_end_fires_what_is_still_due():
    async def scenario(churn):
        churn.steps_began(3, within=60.0)  # the launcher saw 3 steps pass at once: 3 x 2 kills, not 2
        assert len(churn.pending) == 6
        churn.step_ended()  # the next version came before the timers: the step's kills happen now

    table, churn = run(scenario)
    assert len(table.kills) == 6 and churn.pending == {}


def test_a_stopped_churn_kills_nothing_more():
    async def scenario(churn):
        churn.steps_began(2, within=0.05)
        churn.stop()  # the run reached its last version
        await asyncio.sleep(0.2)
        churn.steps_began(1, within=0.0)
        churn.step_ended()

    table, churn = run(scenario)
    assert table.kills == [] and churn.pending == {}


def test_the_remainder_of_a_share_is_a_coin_toss():
    table = Table(4)

    async def main():
        churn = Churn(table, 0.4, random.Random(1))  # 1.6 kills a step on average
        for _ in range(500):
            churn.steps_began(1, within=60.0)
            churn.step_ended()

    asyncio.run(main())
    assert 1.5 < len(table.kills) / 500 < 1.7


def test_a_fraction_outside_zero_to_one_is_refused():
    async def main():
        with pytest.raises(ValueError, match="churn is a fraction in \\[0, 1\\], got 1.5"):
            Churn(Table(2), 1.5, random.Random(0))

    asyncio.run(main())
