"""Plan a fleet's differential privacy: from a budget to the noise that meets it.

`fedmq privacy plan` answers "with epsilon E, how much noise lets each agent make N uploads?"
for the agent's own training settings, and prints the [privacy] section to deploy. The
agent does the same computation itself when `privacy.uploads` is set; this command shows the
result before a fleet is started, with what one upload spends.

    fedmq privacy plan --epsilon 4 --uploads 12
    fedmq privacy plan --epsilon 4 --uploads 12 --samples 500 --algorithm fedsoft-async
    fedmq privacy plan --config deploy/agent.toml --set privacy.epsilon=8 --set privacy.uploads=20
"""

from __future__ import annotations

import argparse

from fedmq.config import add_config_arguments, config_from_args
from fedmq.errors import UsageError
from fedmq.privacy import plan_noise, upload_releases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="privacy_command", metavar="COMMAND")
    plan = sub.add_parser("plan", help="the noise multiplier with which N uploads fit a budget",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(plan, ())
    plan.add_argument("--epsilon", type=float, help="the budget (default: privacy.epsilon)")
    plan.add_argument("--uploads", type=int, help="uploads the budget must cover (default: privacy.uploads)")
    plan.add_argument("--samples", type=int,
                      help="the fewest samples an upload trains on (default: agent.min_samples_to_train)")
    plan.add_argument("--algorithm", choices=("cdfl", "fedsoft-async"), default="cdfl",
                      help="what an upload releases: cdfl (model and sketch) or fedsoft-async (model and "
                           "alpha) (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.privacy_command != "plan":
        raise UsageError("say `plan` (fedmq privacy plan --help)")
    cfg = config_from_args(args)
    p, a = cfg.privacy, cfg.agent
    epsilon = p.epsilon if args.epsilon is None else args.epsilon
    uploads = p.uploads if args.uploads is None else args.uploads
    n = a.min_samples_to_train if args.samples is None else args.samples
    if epsilon <= 0 or uploads < 1 or n < 1:
        raise UsageError(f"need --epsilon > 0, --uploads >= 1 and --samples >= 1 (or the same in [privacy] "
                         f"and agent.min_samples_to_train); got {epsilon:g}, {uploads}, {n}")
    batch = p.batch_size or a.batch_size
    sketch = args.algorithm == "cdfl" and a.send_sketch
    alpha = args.algorithm == "fedsoft-async"
    try:
        sigma = plan_noise(epsilon, p.delta, n=n, uploads=uploads, batch_size=batch, epochs=a.epochs,
                           sketch=sketch, alpha=alpha)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from fedmq.privacy import UplinkPrivacy

    one = UplinkPrivacy(epsilon, p.delta).spent(upload_releases(sigma, n, batch, a.epochs, sketch=sketch,
                                                                alpha=alpha))
    releases = ["DP-SGD"] + (["sketch"] if sketch else []) + (["alpha"] if alpha else [])
    print(f"epsilon {epsilon:g} at delta {p.delta:g} over {uploads} uploads of >= {n} samples "
          f"({args.algorithm}: {' + '.join(releases)}, {a.epochs} epochs of batch {batch})")
    print(f"noise multiplier {sigma:.3f} for every mechanism; one upload alone spends epsilon {one:.3g}")
    print("\n[privacy]")
    print(f"epsilon = {epsilon:g}")
    print(f"uploads = {uploads}    # the agent computes the multipliers below itself")
    for key in ("noise_multiplier", "sketch_noise_multiplier", "alpha_noise_multiplier"):
        print(f"# {key} = {sigma:.3f}")
    return 0
