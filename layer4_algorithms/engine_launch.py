"""The engine's launch of a scheduled step: speculation's proposals, the forward pass, the
rows to sample (parallel-sampling children forked at their first token), and the sampling:
on the host (one sync: penalties, logprobs, speculation's verification) or on the device,
where the tokens stay until the next step reads them (async scheduling, launched_step.py).
Grammar rows (structured outputs) are masked first: their masks follow the grammars, which
follow the previous step's tokens, so a step with such rows reads those tokens after its
forward pass is queued and before it samples. Kept apart from the step loop (engine.py)."""
from __future__ import annotations

from .engine_sampling import count_speculation, sample_rows
from .launched_step import LaunchedStep
from .model_runner import StepLogits
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .step_sampling import StepSampler
from .structured import mask_spec


def _plain_sampler(runner) -> bool:
    """The runner samples with layer 4's own sample_tokens (a subclass may treat its logits
    otherwise: layer 5's pipeline runner takes int64 rows as tokens)."""
    return type(runner).sample_tokens is StepSampler.sample_tokens


class EngineLaunchMixin:
    """For LLM: reads self.runner, self.masks, self.grammars, self.speculator, self._stats; calls
    self._complete (engine.py) and self._fork (engine_requests.py)."""

    def _launch(self, out: SchedulerOutput, prev: LaunchedStep | None, sync: bool,
                advanced: list[SchedulerOutput], finished: list[Sequence]
                ) -> tuple[LaunchedStep, LaunchedStep | None]:
        """Run the scheduled step and sample it. sync: the tokens come back as a list (one
        host sync; penalties, logprobs and speculation take this path), else they stay on
        the device and are copied back without waiting (read by `_complete`). Returns the
        launched step and prev, or None when it was read here: a step that masks grammar
        rows reads prev's tokens after launching its forward pass and before sampling (the
        masks follow the grammars, which follow the tokens)."""
        if self.speculator is not None:
            self.speculator.propose(out)
        # decoding sequences' inputs may be prev's tokens, still on the device
        logits = self.runner.execute(out, prev.device_tokens if prev is not None else None)
        return self._sample_launch(out, logits, prev, sync, advanced, finished)

    def _sample_launch(self, out: SchedulerOutput, logits: StepLogits, prev: LaunchedStep | None,
                       sync: bool, advanced: list[SchedulerOutput], finished: list[Sequence]
                       ) -> tuple[LaunchedStep, LaunchedStep | None]:
        """`_launch` once the step's logits are there (or queued on the device): the rows to
        sample, then the sampling. (A pipeline with steps in flight calls it when a step's
        logits come back: layer 5.)"""
        row_ids, who, spec = self._sampling_rows(out, logits)
        self._stats.steps += 1
        n = len(out.scheduled)  # (plain decodes: one token each; forks since then add rows)
        self._stats.batched_tokens += n if n == out.plain_decodes else sum(
            [s.num_new_tokens for s in out.scheduled]) + (
            sum(len(s.spec_token_ids) for s in out.scheduled) if spec else 0)
        rows = logits.rows_of(row_ids)
        if not sync:
            # (no live request with structured outputs: no grammar row to look for)
            constrained = self._grammars_live and any([q.grammar is not None for q in who])
            if prev is not None and constrained:  # the masks follow prev's tokens
                self._complete(prev, advanced, finished)  # while the GPU runs the forward
                prev = None
            prepared = self.masks.prepare(who) if constrained else None
            # the decode graph's own argmax serves unmasked rows in order (an all-greedy step)
            argmax = logits.argmax if rows is logits.last else None
            return self._sample_on_device(out, rows, who, prepared, argmax), prev
        launched = LaunchedStep.on_host(out, who, sample_rows(self.runner, rows, who, self.masks),
                                        self.runner.last_bad)
        if spec:
            launched.sampled.update(self._verify(spec))
        return launched, prev

    def _sample_on_device(self, out: SchedulerOutput, rows, who: list[Sequence],
                          prepared: tuple | None, argmax=None) -> LaunchedStep:
        """Mask the prepared constrained rows (one copy, one kernel) and sample on the device;
        the tokens stay there (their copy back starts behind the sampling). argmax: the
        unmasked rows' argmax already on the device (the decode graph's, over its input ids),
        for greedy rows; with masked rows the apply's CUDA graph, when it replays, writes
        theirs over it (TokenMasks.argmax: the next step's ids again need no copy)."""
        if (not self._random_live and prepared is None and argmax is not None
                and argmax.shape[0] == len(who) and _plain_sampler(self.runner)):
            # every live request greedy, the graph's argmax in hand: sample_tokens would
            # return it as it is, after a pass over the rows' params (what it checks)
            self.runner.last_bad = None
            return LaunchedStep.on_device(out, who, argmax, None)
        params = [q.params for q in who]
        if prepared is not None:  # greedy: into the decode graph's ids when rows are its own
            greedy = all([p.greedy for p in params]) and (argmax if argmax is not None else True)
            self.masks.launch(rows, prepared, argmax=greedy)
            argmax = self.masks.argmax
        tokens = self.runner.sample_tokens(rows, params, [q.generator for q in who],
                                           argmax=argmax)
        return LaunchedStep.on_device(out, who, tokens, self.runner.last_bad)

    def _sampling_rows(self, out: SchedulerOutput,
                       logits: StepLogits) -> tuple[list[int], list[Sequence], list]:
        """Which logits row each sampling sequence takes (parallel-sampling children share
        their parent's, forked here at its first token), and the speculating sequences with
        their verify logits."""
        if not logits.spec and None not in logits.row:  # every sequence samples its own row
            who = [s.seq for s in out.scheduled]
            if not any([q.pending_forks for q in who]):  # (the common case: no fork)
                return list(logits.row), who, []
        row_ids, who, spec = [], [], []
        for i, s in enumerate(list(out.scheduled)):  # a copy: forks append to it
            row = logits.row[i]
            if row is None:
                continue
            if s.spec_token_ids:
                spec.append((s, logits.spec[i]))
                continue
            row_ids.append(row)
            who.append(s.seq)
            if s.seq.pending_forks:  # its children sample from its row, right behind it
                children = self._fork(s, out)
                row_ids += [row] * len(children)
                who += children
        return row_ids, who, spec

    def _verify(self, spec: list) -> dict[int, list[int]]:
        """Speculation's drafts checked by the target: the tokens to append per sequence."""
        mask_spec(spec)  # constrained sequences: drafts checked against the grammar
        verified = self.speculator.verify(spec)
        count_speculation(spec, verified)
        return verified
