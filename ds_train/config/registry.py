"""The names of the pluggable algorithms, and what the config and the loops need to know of each:
RL advantage estimators (`ript.advantage`), loss aggregations (`ript.loss_agg_mode`), KL estimators
(`ript.kl_estimator`), corrections for the rollout engine's log-probs (`ript.rollout_correction`) and
preference losses (`dpo.loss`). verl's register_adv_est pattern, with the
names kept below the code that imports torch.

The config reads the names here for its type check, its error for a bad value and `--help-config`,
so it never imports the algorithms. The built-in names are declared below with their help and
properties; their functions attach themselves by name where they are defined
(ds_train/ript/algorithms.py, ds_train/train/preference.py). A name registered anywhere else, with
its help and properties (`@ADVANTAGES.register("mine", help="...")`), is declared and attached at
once: its module must be imported before the config is read. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Generic, Literal, TypeVar


@dataclass(frozen=True)
class Entry:
    """A registered name: what `--help-config` says of it, and its function (None until the module
    that defines it is imported)."""

    name: str
    help: str
    fn: Callable | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Estimator(Entry):
    """An advantage estimator: rewards [groups, K] -> advantages [groups, K]."""

    scaled: bool = False  # takes ript.scale_rewards: fn(rewards, batch_std, scale), else fn(rewards, batch_std)


@dataclass(frozen=True)
class PreferenceLoss(Entry):
    """A preference loss of the log-prob margin h: fn(h, beta, label_smoothing) -> per-pair losses."""

    normalised: bool = False  # compares per-token mean log-probs (else the sums)
    smoothed: bool = False  # takes dpo.label_smoothing


E = TypeVar("E", bound=Entry)


class UnknownName(KeyError, ValueError):
    """A name no function was registered under (a KeyError for the mapping, a ValueError for a caller)."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Mapping, Generic[E]):
    """Names -> functions of one kind (a read-only mapping), with each name's Entry (`entry(name)`)."""

    def __init__(self, what: str, kind: type[E] = Entry):
        self.what, self.kind = what, kind
        self._entries: dict[str, E] = {}

    def declare(self, name: str, help: str, **props) -> None:
        """A built-in name: its help and properties, known before its function is imported."""
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is declared twice")
        self._entries[name] = self.kind(name, help, **props)

    def register(self, name: str, **props) -> Callable[[Callable], Callable]:
        """A decorator: the function of `name`. A declared name takes no properties (they are declared);
        a new one takes its help (default: its docstring's first line) and properties."""
        def attach(fn: Callable) -> Callable:
            entry = self._entries.get(name)
            if entry is not None and props:
                raise ValueError(f"{self.what} {name!r} is declared in ds_train/config/registry.py; give its "
                                 f"properties there, not to register()")
            if entry is not None and entry.fn is not None and entry.fn is not fn:
                raise ValueError(f"{self.what} {name!r} is registered twice ({entry.fn.__qualname__}, "
                                 f"{fn.__qualname__})")
            if entry is None:
                help = props.pop("help", None) or (fn.__doc__ or name).strip().splitlines()[0]
                entry = self.kind(name, help, **props)
            self._entries[name] = replace(entry, fn=fn)
            return fn
        return attach

    def entry(self, name: str) -> E:
        if name not in self._entries:
            raise UnknownName(f"unknown {self.what} {name!r}; one of {', '.join(self._entries)}")
        return self._entries[name]

    def __getitem__(self, name: str) -> Callable:
        fn = self.entry(name).fn
        if fn is None:
            raise UnknownName(f"{self.what} {name!r}: no function registered (its module is not imported)")
        return fn

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def where(self, **props) -> tuple[str, ...]:
        """The names whose entries have these properties."""
        return tuple(n for n, e in self._entries.items() if all(getattr(e, k) == v for k, v in props.items()))

    @property
    def choices(self):
        """The config's type for a field naming one of these: Literal[every name registered now]."""
        return Literal[self.names()]

    def help(self, intro: str) -> Callable[[], str]:
        """A field's help for `--help-config`: `intro: name, help; name, help.`, read when printed
        (so that it lists the names registered by then)."""
        return lambda: f"{intro}: " + "; ".join(f"{e.name}, {e.help}" for e in self._entries.values()) + "."


ADVANTAGES: Registry[Estimator] = Registry("advantage estimator", Estimator)
ADVANTAGES.declare("rloo", "leave-one-out (RIPT; Ahmadian et al. 2024)")
ADVANTAGES.declare("grpo", "group mean and std (Shao et al. 2024; DAPO), scaled as scale_rewards says", scaled=True)

LOSS_AGGREGATIONS: Registry[Entry] = Registry("loss aggregation")
LOSS_AGGREGATIONS.declare("token-mean", "over every valid token (DAPO, TRL dapo)")
LOSS_AGGREGATIONS.declare("seq-mean-token-mean", "each rollout's token mean, then the mean over rollouts (GRPO, "
                                                 "TRL grpo)")
LOSS_AGGREGATIONS.declare("seq-mean-token-sum-norm", "token sums over rollouts x the most tokens a rollout can "
                                                     "have (Dr. GRPO, TRL dr_grpo)")

KL_ESTIMATORS: Registry[Entry] = Registry("KL estimator")
KL_ESTIMATORS.declare("k1", "log pi - log pi_ref (verl kl)")
KL_ESTIMATORS.declare("k3", "the low-variance exp(d) - d - 1 (verl low_var_kl, GRPO's)")

ROLLOUT_CORRECTIONS: Registry[Entry] = Registry("rollout correction")
ROLLOUT_CORRECTIONS.declare("tis", "each token's own min(pi_old / pi_rollout, cap) (verl's token level, TRL's TIS)")
ROLLOUT_CORRECTIONS.declare("seq-tis", "one min(prod of the rollout's token ratios, cap) for all its tokens (verl's "
                                       "sequence level)")

PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss", PreferenceLoss)
PREFERENCE_LOSSES.declare("sigmoid", "DPO (Rafailov et al. 2023), -log sigmoid(beta x margin) of the summed log-prob "
                                     "ratios", smoothed=True)
PREFERENCE_LOSSES.declare("ipo", "IPO (Azar et al. 2023), (margin - 1 / (2 beta))^2 on per-token mean log-probs "
                                 "(as TRL)", normalised=True)
PREFERENCE_LOSSES.declare("sigmoid_norm", "DPO on per-token mean log-probs (length-normalised: a longer completion "
                                          "is not favoured for its length)", normalised=True, smoothed=True)
