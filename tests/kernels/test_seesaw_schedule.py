"""The seesaw kernel's barrier protocol (gluon_seesaw.py, gluon_seesaw_ring.py), played on the CPU: the producer and
both consumers as Python generators that wait, arrive, copy, read and write in the kernel's order and with its
slot and parity arithmetic, interleaved at random. Gluon kernels do not run under the interpreter and this one has
not run on a GPU, so this is where a deadlock, a parity wait that aliases another phase, or a write over a slot that
a dot still reads shows before a GPU session. It models the schedule, not the kernel: a change to either file's
waits, arrivals or ring arithmetic belongs here too.

mbarrier semantics as PTX gives them: a phase completes when its pending count reaches zero; try_wait.parity(P)
passes once the phase of parity P has completed, which is right only while the barrier is at most one phase
past the one awaited (checked at every poll). Copies and dots are asynchronous: a copy writes its slot from issue
to landing (then arrives on `ready`), a dot reads its operands from issue to its warpgroup_mma_wait. Not modelled:
memory ordering (the proxy fences, and the second consumer's wait on a tile's `ready`, there for the acquire only).
"""

import random

import pytest


class Barrier:
    def __init__(self, name: str, count: int) -> None:
        self.name, self.count, self.pending, self.phase = name, count, count, 0  # phase: completed phases

    def arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passed(self, parity: int, k: int) -> bool:
        """try_wait.parity(parity), for a waiter that means the completion of phase k (-1: a fresh barrier's
        'previous' phase)."""
        assert parity == k & 1, (self.name, parity, k)
        assert k <= self.phase <= k + 1, (
            f"{self.name}: waiting for phase {k} at {self.phase}: the parity aliases"
        )
        return self.phase & 1 != parity


class Smem:
    """What each region holds, and the asynchronous reads and writes in flight over it."""

    def __init__(self) -> None:
        self.tag: dict[str, object] = {}
        self.reading: dict[str, set[str]] = {}
        self.writing: set[str] = set()

    def start_write(self, region: str, who: str) -> None:
        assert region not in self.writing, f"{who}: {region} written while a copy still writes it"
        assert not self.reading.get(region), f"{who}: {region} written while {self.reading[region]} read it"
        self.writing.add(region)

    def end_write(self, region: str, tag: object) -> None:
        self.writing.discard(region)
        self.tag[region] = tag

    def store(self, region: str, tag: object, who: str) -> None:
        self.start_write(region, who)
        self.end_write(region, tag)

    def start_read(self, region: str, want: object, who: str) -> None:
        assert region not in self.writing, f"{who}: {region} read while a copy writes it"
        if want is not None:
            assert self.tag.get(region) == want, f"{who}: {region} holds {self.tag.get(region)}, not {want}"
        self.reading.setdefault(region, set()).add(who)

    def end_read(self, region: str, who: str) -> None:
        self.reading[region].discard(who)

    def load(self, region: str, want: object, who: str) -> None:
        self.start_read(region, want, who)
        self.end_read(region, who)


class Kernel:
    """One CTA of stage1_seesaw over a split of `tiles` tiles, SLOTS ring slots."""

    def __init__(self, tiles: int, slots: int, prefetch: bool) -> None:
        self.tiles, self.SLOTS, self.PREFETCH = tiles, slots, prefetch
        self.smem = Smem()
        self.ready = [Barrier(f"ready[{i}]", 1) for i in range(slots)]
        self.empty = [Barrier(f"empty[{i}]", 2) for i in range(slots)]  # both consumers read every slot
        self.sent = [Barrier(f"sent[{i}]", 1) for i in range(2)]
        self.summed = [Barrier(f"summed[{i}]", 1) for i in range(2)]
        self.q_ready = Barrier("q_ready", 1)
        self.copies: list = []  # copies in flight: each lands when the scheduler picks it

    # Every action below first yields: the scheduler may run another partition, or land a copy, between any two.

    def wait(self, bar: Barrier, parity: int, k: int):
        """Block until `bar` passes parity (the phase k awaited): yields the test the scheduler polls."""
        while not bar.passed(parity, k):
            yield lambda: bar.passed(parity, k)

    def arrive(self, bar: Barrier):
        yield
        bar.arrive()

    def store(self, region: str, tag: object, who: str):
        yield
        self.smem.store(region, tag, who)

    def load(self, region: str, want: object, who: str):
        yield
        self.smem.load(region, want, who)

    def copy(self, regions: dict[str, object], bar: Barrier, who: str):
        """Issue a copy (cp.async or TMA) into `regions`; it lands when the scheduler picks it, then arrives."""
        yield
        for region in regions:
            self.smem.start_write(region, who)

        def land() -> None:
            for region, tag in regions.items():
                self.smem.end_write(region, tag)
            bar.arrive()

        self.copies.append(land)

    def dot(self, reads: dict[str, object], who: str):
        """Issue a dot (is_async) over the regions `reads` (each with what it must hold, or None: unchecked)."""
        yield
        for region, want in reads.items():
            self.smem.start_read(region, want, who)
        return reads

    def dot_wait(self, reads: dict[str, object], who: str):
        yield
        for region in reads:
            self.smem.end_read(region, who)

    # gluon_seesaw_ring.producer
    def producer(self):
        SLOTS, who = self.SLOTS, "producer"
        yield from self.copy({"q": "q"}, self.q_ready, who)
        for t in range(2 * -(-self.tiles // 2)):
            slot = t % SLOTS
            yield from self.wait(self.empty[slot], ((t // SLOTS) & 1) ^ 1, t // SLOTS - 1)
            yield from self.copy({f"k{slot}": ("k", t), f"rope{slot}": ("rope", t)}, self.ready[slot], who)

    # gluon_seesaw._issue_scores
    def issue_scores(self, t: int, who: str, exists: bool = True):
        SLOTS = self.SLOTS
        slot = t % SLOTS
        if exists:
            yield from self.wait(self.ready[slot], (t // SLOTS) & 1, t // SLOTS)
        want = (("k", t), ("rope", t)) if exists else (None, None)  # past the last pair: a stale slot, unused
        return (yield from self.dot({"q": "q", f"k{slot}": want[0], f"rope{slot}": want[1]}, who))

    # gluon_seesaw._receive
    def receive(self, c: int, j: int, t: int):
        yield from self.wait(self.sent[1 - c], j & 1, j)
        yield from self.wait(self.ready[t % self.SLOTS], (t // self.SLOTS) & 1, t // self.SLOTS)

    # gluon_seesaw._consumer
    def consumer(self, c: int):
        SLOTS, who = self.SLOTS, f"consumer {c}"
        yield from self.wait(self.q_ready, 0, 0)
        pairs = -(-self.tiles // 2)
        if c == 0 and self.PREFETCH:
            s = yield from self.issue_scores(0, who)
            yield from self.dot_wait(s, who)
        for j in range(pairs):
            a, b = 2 * j, 2 * j + 1
            slot_a, slot_b = a % SLOTS, b % SLOTS
            p_a, p_b, v_a, v_b = f"rope{slot_a}", f"rope{slot_b}", f"k{slot_a}", f"k{slot_b}"
            if c == 0:
                if not self.PREFETCH:
                    s = yield from self.issue_scores(a, who)
                    yield from self.dot_wait(s, who)
                yield from self.store(p_a, ("p", a), who)  # _publish: p over the rope columns, then m_a
                yield from self.store("m_a", ("m", a), who)
                yield from self.arrive(self.sent[0])
                acc = yield from self.dot({p_a: ("p", a), v_a: ("k", a)}, who)
                yield from self.receive(c, j, b)
                yield from self.load("m_b", ("m", b), who)
                yield from self.dot_wait(acc, who)
                yield from self.arrive(self.empty[slot_a])
            else:
                s = yield from self.issue_scores(b, who)
                yield from self.dot_wait(s, who)
                yield from self.receive(c, j, a)
                yield from self.load("m_a", ("m", a), who)
                acc = yield from self.dot({p_a: ("p", a), v_a: ("k", a)}, who)
                yield from self.store(p_b, ("p", b), who)
                yield from self.store("m_b", ("m", b), who)
                yield from self.arrive(self.sent[1])
                yield from self.dot_wait(acc, who)
                yield from self.arrive(self.empty[slot_a])
            acc = yield from self.dot({p_b: ("p", b), v_b: ("k", b)}, who)
            if c == 0 and self.PREFETCH:
                s = yield from self.issue_scores(a + 2, who, a + 2 < 2 * pairs)
                yield from self.dot_wait(s, who)
            yield from self.dot_wait(acc, who)
            yield from self.arrive(self.empty[slot_b])
        yield from self.store(f"sums{c}", "sum", who)
        yield from self.arrive(self.summed[c])
        yield from self.wait(self.summed[1 - c], 0, 0)
        yield from self.load(f"sums{1 - c}", "sum", who)


def play(tiles: int, slots: int, prefetch: bool, seed: int) -> None:
    """Run the three partitions and the copies to the end in one random interleaving; fail on a deadlock."""
    kernel = Kernel(tiles, slots, prefetch)
    rng = random.Random(seed)
    parts = {
        "producer": kernel.producer(),
        "consumer 0": kernel.consumer(0),
        "consumer 1": kernel.consumer(1),
    }
    blocked = dict.fromkeys(parts)
    while parts or kernel.copies:
        runnable = [name for name in parts if blocked[name] is None or blocked[name]()]
        choices = runnable + [None] * len(kernel.copies)
        assert choices, f"deadlock: {sorted(parts)} all wait, no copy in flight"
        pick = rng.choice(choices)
        if pick is None:
            kernel.copies.pop(rng.randrange(len(kernel.copies)))()
            continue
        try:
            blocked[pick] = next(parts[pick])
        except StopIteration:
            del parts[pick]
    assert all(not readers for readers in kernel.smem.reading.values())


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("slots", [4, 2])  # 32-row tiles, 64-row tiles
@pytest.mark.parametrize("tiles", [1, 2, 3, 4, 5, 7, 8, 9])
def test_every_interleaving_runs_to_the_end_without_a_race(tiles, slots, prefetch):
    for seed in range(40):
        play(tiles, slots, prefetch, seed)
