"""The rounds' loop (usage/periodic.py): every interval, and at once when someone asks for a fresh round."""

import asyncio

from gpu_quota_ext.usage.periodic import every


def test_a_wake_starts_the_next_round_without_waiting_out_the_interval():
    async def scenario():
        rounds = []
        first, second = asyncio.Event(), asyncio.Event()
        wake = asyncio.Event()

        async def one_round():
            rounds.append(len(rounds))
            (first if len(rounds) == 1 else second).set()

        task = asyncio.ensure_future(every(lambda: 3600.0, one_round, lambda error: None, wake))
        await asyncio.wait_for(first.wait(), 30)
        wake.set()  # an hour-long interval: only the wake can bring the second round
        await asyncio.wait_for(second.wait(), 30)
        task.cancel()
        return rounds

    assert asyncio.run(scenario()) == [0, 1]


def test_a_wake_made_before_a_round_is_served_by_that_round():
    async def scenario():
        wake = asyncio.Event()
        rounds = []
        first = asyncio.Event()

        async def one_round():
            rounds.append(wake.is_set())
            first.set()

        wake.set()  # asked before the loop began: the first round is the fresh one
        task = asyncio.ensure_future(every(lambda: 3600.0, one_round, lambda error: None, wake))
        await asyncio.wait_for(first.wait(), 30)
        await asyncio.sleep(0)
        task.cancel()
        return rounds

    assert asyncio.run(scenario()) == [False]  # cleared as the round began, so no second round at once
