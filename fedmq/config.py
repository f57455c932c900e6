"""One typed configuration object for every role, with defaults.

Precedence, lowest first: the defaults below, a TOML file (`--config FILE.toml`), then
command-line flags (`--set section.key=value` or a role's own flags). Sections are plain
dataclasses so that a newcomer can read every knob and its default in one place; the
reference page docs/config.md is written from these docstrings.

    cfg = load_config("fleet.toml", overrides={"broker.url": "mqtt://10.0.0.2:1883"})
    cfg.broker.url
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmq.broker_urls import parse_broker_urls
from fedmq.dataset_names import canonical_dataset, dataset_for_data_dir
from fedmq.errors import UsageError

if TYPE_CHECKING:
    from fedmq.privacy import UplinkPrivacy


class ConfigError(UsageError):
    """A config file or override that does not fit the schema (exit status 2)."""


def user_cache_root() -> str:
    """$XDG_CACHE_HOME/fedmq, else ~/.cache/fedmq: data and the disk cache live under it."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fedmq")


def default_data_dir() -> str:
    """`FEDMQ_DATA_DIR`, else the user's cache dir (XDG), in torchvision's own layout."""
    return os.environ.get("FEDMQ_DATA_DIR") or os.path.join(user_cache_root(), "data")


@dataclass
class BrokerSettings:
    """Where the MQTT broker is and how to talk to it."""

    url: str = "mqtt://127.0.0.1:1883"
    """mqtt://[user:pass@]host[:port], or mqtts://... for TLS; a broker cluster's nodes separated by commas (failover, docs/scaling.md). A user with no password (mqtts://car-1@host) reads it from FEDMQ_BROKER_PASSWORD, which other users cannot read, unlike argv."""
    ca_file: str = ""
    """CA bundle that signed the broker's certificate (mqtts)."""
    cert_file: str = ""
    """Client certificate for mutual TLS (optional)."""
    key_file: str = ""
    """Key of the client certificate."""
    tls_insecure: bool = False
    """Skip hostname verification (development only)."""
    keepalive_s: int = 30
    """MQTT keepalive; a dead client is declared offline after about 1.5x this. Must be >= 1."""
    protocol: str = "auto"
    """auto (MQTT v5, fall back to 3.1.1), 5 or 3.1.1."""
    max_inflight: int = 64
    """Unacknowledged QoS 1 publishes per client (1-65535), clamped to the broker's Receive Maximum and taken as its in-flight window toward this client; set it to the broker's window when that is smaller and not announced (MQTT 3.1.1, RabbitMQ). docs/reliability.md. Must be in [1, 65535]."""
    reconnect_min_s: float = 0.5
    """First reconnect delay, in seconds; it doubles up to reconnect_max_s. Must be > 0."""
    reconnect_max_s: float = 30.0
    """Longest reconnect delay, in seconds. Must be > 0 and >= reconnect_min_s."""
    session_expiry_s: int = 7 * 24 * 3600
    """How long the broker keeps a persistent session (MQTT v5). Must be >= 0."""


@dataclass
class ProtocolSettings:
    """Wire limits: what the decoder accepts and how large payloads are split."""

    max_message_bytes: int = 64 * 1024 * 1024
    """Hard limit on one logical message (after reassembly); larger is refused. Must be >= 1."""
    chunk_bytes: int = 8 * 1024 * 1024
    """Payloads above this are split into chunks of this size. Must be >= 1."""
    chunk_timeout_s: float = 30.0
    """A partial message older than this is dropped with a reason. Must be > 0."""
    max_pending_bytes: int = 256 * 1024 * 1024
    """Memory bound for all partially reassembled messages together. Must be >= 1."""
    max_chunks: int = 64
    """Most pieces one chunked message may declare (integer >= 1); more is refused at its first piece (too_large). A receiver also refuses more than half its in-flight window (broker.max_inflight) of pieces. docs/reliability.md."""
    max_partials_per_sender: int = 2
    """Partial (chunked) messages one sender may have open at once; more are refused, so one flooding agent cannot take the others' share of max_pending_bytes. Must be >= 1."""


@dataclass
class CodecSettings:
    """How model vectors are compressed on the wire (uplink and downlink)."""

    name: str = "int8"
    """fp32, fp16, int8 (blockwise scale) or topk (largest entries only; agents send it with error feedback, see error_feedback and docs/codecs.md)."""
    zstd: bool = True
    """Follow the codec with zstd."""
    delta: bool = True
    """Encode the difference from a base vector both sides hold."""
    int8_block: int = 256
    """Values per int8 block; each block carries one fp32 scale. Must be >= 1."""
    topk_ratio: float = 0.05
    """Share of entries topk sends; the rest of each vector is not sent. Must be in (0, 1]."""
    error_feedback: bool = True
    """With topk, an agent keeps what it did not send and adds it to its next upload (codecs.ErrorFeedback), so nothing is lost, only delayed; false drops it (the ablation). Downlinks need none: each reply is a delta against what the agent decoded, so its error is corrected by the next."""
    exact_statistics: bool = True
    """A lossy codec sends a model's batch-norm running statistics (its vector's tail) as float32: int8 blocks shared with weights zeroed small variances (MobileNetV3-small: 0.81 -> 0.47 accuracy). 0.8 % of its values; none without batch norm. false: coded like the weights."""
    downlink: str = ""
    """Codec of what the aggregator sends (replies, round invites): fp32, fp16, int8 or topk; empty = the same as name. With topk uplinks, int8 here keeps the agents' models whole for about 2x the downlink bytes (docs/codecs.md, "Top-k in a fleet")."""

    def uses_feedback(self) -> bool:
        """Whether a sender keeps an ErrorFeedback residual for this codec."""
        return self.name == "topk" and self.error_feedback

    def encoder_params(self, name: str | None = None, statistics: int = 0) -> dict[str, Any]:
        """The keyword arguments `codecs.encode` takes for codec `name` (default: this uplink's),
        for a model whose vector ends with `statistics` running-statistics values."""
        name = name or self.name
        exact = {"exact": statistics} if statistics and self.exact_statistics and name != "fp32" else {}
        if name == "int8":
            return {"block": self.int8_block, **exact}
        if name == "topk":
            return {"ratio": self.topk_ratio, **exact}
        return exact

    def downlink_codec(self, statistics: int = 0) -> tuple[str, dict[str, Any]]:
        """(codec name, encoder arguments) for what the aggregator sends; ConfigError if unknown."""
        from fedmq.codecs import CODECS

        name = self.downlink or self.name
        if name not in CODECS:
            raise ConfigError(f"codec.downlink: unknown codec {name!r}; use {', '.join(CODECS)} (or empty: as codec.name)")
        return name, self.encoder_params(name, statistics)


@dataclass
class DataSettings:
    """Datasets and how agents' local data is drawn."""

    dataset: str = "digits"
    """digits (scikit-learn's, offline), synthetic, shapes (generated; 32x32 colour), shapes-lit (the same, lit from above), mnist, fashionmnist, cifar10, cifar100, svhn, usps (from data_dir), folder:NAME (PNGs in <data_dir>/NAME/{train,test}/<class>/) or module.path:factory (your loader; docs/data.md)."""
    data_dir: str = field(default_factory=default_data_dir)
    """Dataset root, in torchvision's own layout."""
    download: bool = False
    """Allow torchvision to download a missing dataset (never in tests)."""
    min_samples: int = 500
    """Fewest samples an agent holds. Must be >= 1."""
    max_samples: int = 2000
    """Most samples an agent holds. Must be >= 1 and >= min_samples."""
    primary_min: float = 0.4
    """Smallest share of an agent's data from its primary cluster. Must be in [0, 1]."""
    primary_max: float = 0.9
    """Largest share of an agent's data from its primary cluster. Must be in [0, 1] and >= primary_min."""
    proxy_per_cluster: int = 0
    """Server-side proxy samples per cluster (CDFL's D_k); integer >= 0. 0 = auto: the paper's 1000, or what fits in half the train split beside the pre-training sets (digits at K = 3: 209). A value that does not fit is refused, naming the largest that does."""
    pretrain_per_cluster: int = 0
    """Samples per cluster the server pre-trains its cluster models on. 0 = auto: the paper's 2000, or what fits (digits at K = 3: 418); see proxy_per_cluster. Must be >= 0."""
    public_images: int = 0
    """Unrotated train images the server holds as public data, in no other pool (the same for every seed and K); every cluster specializes from a start model trained on them (`fedmq start-model`). 0 = none; -1 = auto: 10,000 or a fifth of the train split. Must be >= -1."""


@dataclass
class CDFLSettings:
    """Server side of CDFL (and the FedSoft-Async / FedAsync baselines). See docs/cdfl.md."""

    clusters: int = 3
    """K, the number of soft-cluster models. Must be >= 1."""
    tau0: int = 0
    """Staleness threshold: uploads with staleness > tau0 leave clusters unchanged. 0 = number of agents seen. Must be >= 0."""
    staleness_cap: int = 1
    """Times each agent's uploads count toward an upload's staleness (integer >= 0; 1: staleness = 1 + agents that uploaded since, so a frequent uploader cannot make others stale; 0 = every upload counts, the papers' t - tau). Also FedSoft-Async and FedAsync."""
    beta0: float = 0.025
    """Base update ratio (the paper's value); beta_mk = beta0 * alpha_mk * s(t - tau). Must be in [0, 1]."""
    hinge_a: float = 10.0
    """Hinge staleness slope: s(d) = 1 if d <= b else 1 / (a (d - b) + 1). Must be >= 0."""
    hinge_b: float = 5.0
    """Hinge staleness knee b: staleness up to b counts fully. Must be >= 0."""
    estimator: str = "sketch"
    """How alpha is estimated: sketch (NNLS of the agent's 2 KB data sketch on the clusters' reference sketches; uploads without one use sketch_fallback), metrics (the paper's softmax of loss / gap / distance), direction, evidence or trajectory. See docs/cdfl.md and docs/results_cdfl.md#estimation."""
    metric_weights: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    """Convex weights of the loss, loss-gap and distance distributions."""
    temperature: float = 1.0
    """Softmax temperature over each scale-normalized metric. Must be > 0."""
    proxy_batch: int = 1000
    """Proxy samples per evaluation batch. Must be >= 1."""
    metrics_normalize: str = "mean"
    """metrics estimator: scale each metric by its mean (or std) across clusters before the softmax."""
    direction_at: str = "base"
    """direction estimator: take proxy gradients at the model the agent received (base)."""
    evidence_mode: str = "gain"
    """evidence estimator: gain (upload vs received model) in the true label's probability."""
    estimator_floor: float = 0.05
    """direction/evidence/trajectory: mix this much uniform into alpha (KL stays finite, no cluster starves). Must be in [0, 1]."""
    sketch_fallback: str = "metrics"
    """sketch estimator: the estimator used for uploads that carry no data sketch (agent.send_sketch off, or an older agent)."""
    sketch_floor: float = 0.01
    """sketch estimator: mix this much uniform into alpha. Must be in [0, 1]."""
    sketch_shrinkage: float = 0.25
    """sketch estimator: the mixture is fitted by least squares in the metric of the features' noise, its covariance shrunk this far toward its mean variance (in (0, 1]; 1 = plain least squares). docs/results_cdfl.md#estimation."""
    sketch_pretrain: bool = True
    """sketch estimator: a cluster's reference sketch is made from its proxy and pre-training inputs (labels unused), not the proxy set alone (less reference noise). docs/results_cdfl.md#estimation."""
    trajectory_epochs: int = 2
    """trajectory estimator: epochs of each simulated per-cluster run (match the agents' local training). Must be >= 0."""
    trajectory_lr: float = 0.05
    """trajectory estimator: learning rate of the simulated runs. Must be > 0."""
    trajectory_rho: float = 0.1
    """trajectory estimator: proximal strength of the simulated runs. Must be >= 0."""
    eval_formulation: str = "auto"
    """Proxy evaluation: auto (fused on CPU when it reproduces the model, else stacked), fused (conv1+pool as window GEMMs, worker threads), stacked, or vmap. See docs/cdfl.md."""
    eval_workers: int = 0
    """fused: worker threads (0 = torch's thread count). Must be >= 0."""
    eval_chunk: int = 0
    """Proxy samples per evaluation chunk (0 = the evaluator's default for the device). Must be >= 0."""
    eval_compile: bool = False
    """torch.compile the stacked/vmap evaluation (~1.6x those after ~4 s of compiling; the fused default does not use it and is faster)."""
    personalization: str = "finetune"
    """How the reply model is made (aggregator/personalize.py): finetune (its start trained on alpha-weighted proxy data), mixture (the paper's sum_k alpha_k w_k, cheapest), upload, distill or distill-mixture. finetune costs personalize_epochs of training per reply. docs/results_cdfl.md#the-reply."""
    personalize_start: str = "mixture"
    """finetune/distill: the model the reply's training starts from: mixture (sum_k alpha_k w_k; carries what the fleet taught the clusters), upload (the agent's own), dominant (the largest-alpha cluster) or blend (lam from personalize_blend_grid, chosen per reply). docs/results_cdfl.md#the-reply."""
    personalize_mixture_guard: float = 0.1
    """finetune/distill from the mixture: the reply starts from the single cluster that fits 64 of its proxy samples best when the mixture's loss there is higher by more than this (nats; >= 0, 0 = off). Clusters out of one basin average to no model. docs/results_realsize.md."""
    personalize_blend_grid: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """blend: the candidate weights lam of the cluster mixture against the upload."""
    reply_uses_upload: bool = True
    """false: build every reply as if the agent had uploaded nothing (the proxy-only control of an experiment; the clusters still learn from the upload)."""
    personalize_epochs: int = 8
    """finetune/distill: epochs over the alpha-weighted proxy sets per reply (integer >= 0; 0: the start itself is the reply). A reply's cost grows linearly with it. docs/results_cdfl.md#the-reply."""
    personalize_lr: float = 0.01
    """finetune/distill: SGD learning rate (momentum 0.9). Must be > 0."""
    personalize_batch_size: int = 64
    """finetune/distill: proxy samples per SGD step of the reply's training (integer >= 1). docs/results_cdfl.md#the-reply."""
    personalize_min_steps: int = 128
    """finetune/distill: SGD steps a reply trains at least, stretching personalize_epochs over small proxy sets (integer >= 0; 0 = the epochs as set). Not applied when personalize_samples caps the reply. docs/results_cdfl.md#the-reply."""
    personalize_tail_average: float = 0.0
    """finetune/distill: the reply is the mean of its iterates over this last fraction of its SGD steps (in [0, 1]; 0 = the last iterate). Measured no help; off. docs/results_cdfl.md#the-reply."""
    personalize_rho: float = 0.1
    """finetune/distill: proximal weight pulling the reply's training toward its start, loss + (rho/2)||w - start||^2 (>= 0; 0 = none). docs/results_cdfl.md#the-reply."""
    personalize_samples: int = 0
    """finetune/distill: proxy samples per epoch, drawn with replacement in proportion to alpha (0 = every sample of the clusters with alpha > 0, weighted by alpha). Caps a reply's cost whatever K and the proxy sizes are. Must be >= 0."""
    personalize_layers: str = "auto"
    """finetune/distill: what the reply trains: all (every layer), head (the trailing linear layers, over features of the frozen lower part of its start, computed once per reply) or auto (head above personalize_head_above parameters or over a frozen backbone, docs/models.md)."""
    personalize_head_above: int = 1_000_000
    """personalize_layers = auto: models with more parameters than this train the head alone (integer >= 0). docs/results_realsize.md."""
    reply_batch: int = 0
    """finetune: queued uploads whose replies train together as one vmapped batch (integer >= 0; 0 = 8 on a GPU, 1 on a CPU; 1 = one at a time). Same replies up to float rounding. docs/results_cdfl.md#cost, `python -m bench replies`."""
    reply_share: float = 0.0
    """finetune/distill from the mixture: queued uploads whose alphas differ by at most this (largest coordinate, in [0, 1]; 0 = off) take one reply, trained once for their mean alpha from the clusters after the last of them. docs/results_realsize.md#shared-replies."""
    personalize_kd_weight: float = 0.5
    """distill: weight of the specialist teachers' tempered softmax against the true labels. Must be in [0, 1]."""
    personalize_temperature: float = 2.0
    """distill: softmax temperature of teacher and student. Must be > 0."""
    update_rule: str = "delta"
    """How an upload moves the clusters: delta (w_k += server_lr alpha_k s (v - base), the agent's own step in its share), alpha (the paper's pull w_k += beta_k (v - w_k)), sharpen or confidence (alpha reweighted). docs/results_cdfl.md#cluster-updates."""
    update_power: float = 2.0
    """sharpen: the power applied to alpha before renormalizing. Must be > 0."""
    server_lr: float = 1.0
    """delta rule: w_k += server_lr * alpha_k * s(d) * (v - base), the agent's own step added to each cluster in its share (>= 0). From strong pre-trained clusters 0.25 kept them specialists: docs/results_realsize.md#a-smaller-server-step."""
    server_lr_ramp: int = 0
    """delta rule: applied uploads over which the step grows linearly from server_lr to 1 (integer >= 0; 0 = it stays server_lr). On the MobileNetV3 fleet 0.25 grown over 200 lost 3.0 pp to a constant 0.25: docs/results_realsize.md#a-smaller-server-step."""
    delta_hinge_a: float = 0.1
    """delta rule: staleness slope, s(d) = 1 / (a (d - hinge_b) + 1) past hinge_b (the pull rule's 10 would all but ignore a 20-agent fleet's uploads). Must be >= 0."""
    delta_tau0: int = 0
    """delta rule: uploads with t - tau above this leave the clusters unchanged (0 = 5 x the number of agents seen). Must be >= 0."""
    delta_moves_head: bool = False
    """delta rule: whether the agents' steps also move each cluster's output layer (last weight and bias). false: each head stays the specialist its proxy refresh keeps. docs/results_cdfl.md#cluster-updates."""
    trunk_share: float = -1.0
    """delta rule: share of an agent's step below the output layer that every cluster takes whatever its alpha (in [0, 1]; trunk beta_k = server_lr s(d) ((1 - share) alpha_k + share)). -1 = auto: 0.5 with K >= 3, 0 with K = 2. docs/results_cdfl.md#cluster-updates."""
    trunk_guard: bool = False
    """With trunk_share > 0: cluster k takes the shared part of an agent's trunk step only when that does not raise its loss on its own proxy set (compared with the alpha share alone); else the alpha share alone. Costs two proxy evaluations per cluster per upload."""
    direction_guard: float = 0.1
    """delta rule: a step pointing against its clusters' recent direction, below the fleet's cosine floor (0, or lower where honest cosines spread wide), is scaled by 1 + (cos - floor) / this, at least a tenth. >= 0 (0 = off). Limits sign flips; costs honest fleets 0.4-1.3 pp (docs/reliability.md)."""
    cluster_refresh_steps: int = 1
    """SGD mini-batches (64 samples) a moved cluster takes on its own proxy set after each upload, keeping the clusters specialists (integer >= 0; 0 = off, the paper's rule; ~0.04 s an upload). Off for batch-norm models (cluster_refresh.off; a warning if set by hand). docs/results_cdfl.md#cluster-updates."""
    cluster_refresh_lr: float = 0.05
    """Largest learning rate of the cluster refresh (plain SGD): a step raising its batch's loss is retried at half, up to 4 times, then skipped. Must be > 0. docs/results_realsize.md#collapsed-replies-the-servers-proxy-refresh-was-unstable-on-resnet-20."""
    cluster_average: float = 0.995
    """Decay d of the exponential average the server reports as its cluster models, avg_k := d avg_k + (1 - d) w_k per upload (in [0, 1); 0 = report the iterates; 0.995 ~ the last 200 uploads). Replies still come from the iterates. docs/results_cdfl.md#cluster-updates."""
    reply_average: float = 0.0
    """Decay of an exponential average of the cluster iterates that replies are made from instead of the iterates (in [0, 1); 0 = the iterates). Measured no help; off. docs/results_cdfl.md#cluster-updates."""
    cluster_refresh_all: bool = False
    """Refresh every cluster after each upload, not only those with a share of it (with trunk_share > 0 every cluster's lower layers move). docs/results_cdfl.md#cluster-updates."""

    def check(self) -> None:
        """ConfigError naming the first [cdfl] key out of its range (RANGES): said at load and by
        `--dry-run`, not as a traceback when the first reply is made."""
        check_section(self, "cdfl")
        resolve_trunk_share(self.trunk_share, self.clusters)
        if self.personalize_layers not in ("all", "head", "auto"):
            raise ConfigError(f"cdfl.personalize_layers must be all, head or auto, got {self.personalize_layers!r}")


AUTO_TRUNK_SHARE = 0.5
"""What cdfl.trunk_share = -1 (the default) gives at K >= 3 clusters."""


def resolve_trunk_share(share: float, k: int) -> float:
    """cdfl.trunk_share, with -1 (auto) made concrete for K clusters: a shared trunk step helps
    most where each cluster gets the smallest share of the uploads, and with two clusters it
    pulled the two specialists together (docs/results_cdfl.md#cluster-updates)."""
    if share == -1.0:
        return AUTO_TRUNK_SHARE if k >= 3 else 0.0
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"cdfl.trunk_share must be in [0, 1] or -1 (auto), got {share}")
    return float(share)


@dataclass
class CataFedSettings:
    """Deadline rounds: CATA-Fed, server and agent side, and the round itself (deadline, cut-off, rounds, agents to wait for, eps_i), which FedAvg / FedProx share so that all three run under the same deadline; their own knobs are in [fedavg].
    See docs/catafed.md for our reading of the paper and why each default is what it is."""

    groups: int = 3
    """P, the number of data-size clusters (1-D k-means over the agents' per-round data sizes). Must be >= 1."""
    per_group: int = 5
    """N, agents invited per round: the best N of the chosen group (FedAvg / FedProx: fedavg.clients_per_round). Must be >= 1."""
    min_agents: int = 0
    """Agents the aggregator waits for in the pool before round 1 (`--min-agents`); later rounds wait up to 30 s for them, then run with the pool they have. 0 = the agents one round invites: per_group (CATA-Fed) or fedavg.clients_per_round (FedAvg / FedProx). Must be >= 0."""
    deadline_s: float = 10.0
    """T, the round deadline the agents train against, counted from their receipt of the invite. Must be > 0."""
    grace_s: float = 1.0
    """The server's cut-off is T + grace after sending the invites; later reports are dropped. Must be >= 0."""
    close_early: bool = True
    """End a round as soon as every invited agent has reported (else always wait for the cut-off)."""
    rounds: int = 50
    """E, the most rounds to run. Must be >= 1."""
    target_accuracy: float = 0.0
    """Stop once the global model reaches this test accuracy (0 = run all E rounds). Must be in [0, 1]."""
    rate: str = "samples"
    """r_i in the PF priority: samples (the agent's per-round data size) or throughput (samples/s it reported)."""
    pf_window: float = 10.0
    """t_c of the PF average: A_i := (1 - 1/t_c) A_i + (1/t_c) r_i [i was invited], every round. Must be >= 1."""
    pf_initial: float = 1.0
    """A_i of an agent never invited; 0 = its own r_i at joining (every newcomer starts at priority 1). Small values give newcomers a high priority r_i / A_i. Must be >= 0."""
    weights: str = "samples"
    """psi_i: samples (proportional to the samples an agent trained on) or uniform; normalized over finishers."""
    min_shard: int = 32
    """pi, the smallest shard a straggler may halve its data to. Must be >= 1."""
    epochs: int = 2
    """CATA-Fed: local epochs per round (fewer when the deadline is near). Must be >= 1."""
    batch_size: int = 32
    """CATA-Fed: local minibatch size. Must be >= 1."""
    lr: float = 0.05
    """CATA-Fed: local SGD learning rate (momentum 0.9). Must be > 0."""
    eps_initial_s: float = 0.2
    """eps_i before the agent has measured an upload: time kept back from T for sending the report. Must be >= 0."""
    eps_factor: float = 2.0
    """eps_i = eps_factor x the mean of the agent's measured upload times (safety margin). Must be >= 0."""
    eps_min_s: float = 0.05
    """Floor of eps_i. Must be >= 0."""
    selection: str = "pf"
    """Which group is invited: pf (the paper's proportional-fair priority sum) or random (a group uniformly at random, its members at random: the ablation without PF)."""
    deadline_aware: bool = True
    """Agents soft-stop and run the watchdog at T - eps_i (the paper); false: they train all epochs and a late report is dropped (the ablation without deadline-aware training)."""
    partition: bool = True
    """A straggler splits its data into shards (the paper); false: it keeps all its data (the ablation without straggler partitioning)."""
    regrow: bool = False
    """Beyond the paper (which never grows shards back): an agent that finished all its epochs using at most 40 % of its budget doubles its shard again (u := u - 1), so a device that was slow once (busy, throttled) is not stuck on small shards."""
    recluster_every: int = 0
    """Re-cluster only every this many rounds (0 = the paper's reading: before a selection whenever a size changed or the pool gained an agent). Must be >= 0."""
    resize: str = "halve"
    """How a straggler shrinks its shard: halve (the paper: one halving per missed deadline) or fit (beyond the paper: from the throughput it measured in the cut epoch, as many halvings at once as an epoch needs to fit T - eps_i)."""


@dataclass
class FedAvgSettings:
    """The deadline baselines FedAvg and FedProx (`--algorithm fedavg|fedprox`), server and agent side. The deadline, cut-off, rounds and eps_i are [catafed]'s. See docs/catafed.md."""

    clients_per_round: int = 5
    """N, agents invited per round, drawn uniformly at random from the pool. Must be >= 1."""
    epochs: int = 2
    """Local epochs per round (FedAvg trains them all whatever the deadline; FedProx stops at T - eps_i). Must be >= 1."""
    batch_size: int = 32
    """Local minibatch size. Must be >= 1."""
    lr: float = 0.05
    """Local SGD learning rate. Must be > 0."""
    momentum: float = 0.9
    """Local SGD momentum. Must be in [0, 1)."""
    prox_mu: float = 0.01
    """FedProx: strength of the proximal term (mu/2)||w - W_t||^2 (FedAvg ignores it). Must be >= 0."""

    @classmethod
    def like(cls, catafed: CataFedSettings) -> FedAvgSettings:
        """N, E, batch size and lr of CATA-Fed: the like-for-like comparison of sim/rounds.py."""
        return cls(clients_per_round=catafed.per_group, epochs=catafed.epochs,
                   batch_size=catafed.batch_size, lr=catafed.lr)


@dataclass
class FedAsyncSettings:
    """FedAsync (Xie et al. 2019), an asynchronous baseline (`--algorithm fedasync`): one global model mixed with every upload, w := (1 - a_t) w + a_t v, a_t = mixing x s(staleness). The aggregator's pre-training and server data are [cdfl]'s and [data]'s. See aggregator/fedasync.py."""

    mixing: float = 0.6
    """alpha, the mixing weight of a fresh upload. Must be in (0, 1]."""
    hinge_a: float = 10.0
    """Staleness slope: s(d) = 1 / (a (d - b) + 1) past the knee b (CDFL's default). Must be >= 0."""
    hinge_b: float = 5.0
    """Staleness knee b: staleness up to b counts fully. Must be >= 0."""
    staleness_cap: int = 1
    """How often one agent's uploads count towards another's staleness (as cdfl.staleness_cap; 0: every upload, the paper's count). Must be >= 0."""


@dataclass
class FedBuffSettings:
    """FedBuff (Nguyen et al., AISTATS 2022), an asynchronous baseline (`--algorithm fedbuff`): client deltas are buffered, each weighted by (1 + staleness)^-e, and their mean is applied every buffer_size uploads. The aggregator's pre-training and server data are [cdfl]'s and [data]'s. See aggregator/fedbuff.py."""

    buffer_size: int = 10
    """K, uploads buffered before the global model moves (the paper's K = 10). Must be >= 1."""
    server_lr: float = 1.0
    """eta_g, the server step on the buffer's mean delta. Must be > 0."""
    staleness_exponent: float = 0.5
    """e in s(d) = (1 + d)^-e (the paper's 1/sqrt(1 + d)). Must be >= 0."""
    staleness_cap: int = 1
    """How often one agent's uploads count towards another's staleness (as cdfl.staleness_cap; 0: every upload, the paper's count). Must be >= 0."""


@dataclass
class TiflSettings:
    """TiFL (Chai et al., HPDC 2020), a deadline baseline (`--algorithm tifl`): agents profiled into tiers by their measured response latency, one tier invited per round with credit-limited, accuracy-driven probabilities. Agents train as FedAvg's do ([fedavg]: N, epochs, lr); deadline and rounds are [catafed]'s. See docs/catafed.md."""

    tiers: int = 3
    """m, the number of latency tiers (1-D k-means over the agents' measured response latencies). Must be >= 1."""
    interval: int = 5
    """I, rounds between updates of the tier probabilities from the tiers' accuracies (adaptive selection). Must be >= 1."""
    credits: int = 0
    """Times each tier may be chosen over the run (0 = ceil(catafed.rounds / tiers), the paper's even split). Must be >= 0."""
    adaptive: bool = True
    """Adaptive tier selection (lower tier accuracy, higher probability); false: uniform over tiers with credits (TiFL's static policy)."""


MOVED_KEYS: dict[str, str] = {"catafed.prox_mu": "fedavg.prox_mu", "cdfl.fedasync_alpha": "fedasync.mixing"}
"""Keys that moved to another section: setting the old one is an error naming the new one."""


@dataclass
class AggregatorSettings:
    """The aggregator service: algorithm, state, batching, input guards."""

    algorithm: str = "cdfl"
    """cdfl, fedsoft-async, fedasync or fedbuff (asynchronous); catafed, fedavg, fedprox or tifl (deadline rounds, see [catafed], [fedavg] and [tifl])."""
    state_dir: str = "state/aggregator"
    """Snapshots and the write-ahead journal; restart from here resumes."""
    accept_journal_loss: bool = False
    """Start even when the journal is damaged, skipping the damaged bytes (each loss is logged by file and byte range; a copy of the file is kept as NAME.damaged). false: refuse to start and change nothing. Meant for one restart (`--accept-journal-loss`), not for a config file."""
    max_batch: int = 32
    """Most queued uploads evaluated together. Must be >= 1."""
    inbox_max_messages: int = 256
    """Back-pressure: above this many received, unprocessed messages the aggregator stops reading from the broker (resumes at half). Must be >= 1."""
    inbox_max_bytes: int = 64 * 1024 * 1024
    """Back-pressure: the same bound in payload bytes. Must be >= 1."""
    status_every_s: float = 10.0
    """The retained online status (epoch, counters) is re-published when the epoch moved, at most this often (0 = only at connect). Must be >= 0."""
    takeover_grace_s: float = 60.0
    """Of two aggregators on one fleet, the later-started one exits with a clear message rather than trade the MQTT session with the other. A status without a start time makes us the newcomer within this many seconds of our own start. Must be >= 0."""
    heartbeat_s: float = 2.0
    """Seconds between re-publications of the online status while serving (the heartbeat, advertised in it): an aggregator starting on the fleet waits up to 2 heartbeats + 1 s for one and exits if it comes, else takes the status for a dead one's. docs/reliability.md. Must be in [0.1, 60]."""
    max_queued_per_agent: int = 4
    """An agent's uploads waiting beyond this many are refused at once (`rate_limited`, acknowledged; re-sent copies count once), so one agent's flood neither fills the inbox nor delays the others (integer >= 0; 0 = no quota)."""
    pretrain_shared: bool = True
    """Pre-train one model on every cluster's pool, then specialize each cluster from it, so the clusters share a basin and their mixtures (the CDFL reply's start) are models too. false: each cluster from the same seeded init on its own pool. docs/results_cdfl.md#the-reply."""
    pretrain_lr: float = 0.05
    """SGD rate (momentum 0.9) of pre-training from a random init; clusters specialize from the shared model or `init` at a fifth of it. A cluster left at chance's loss logs `cluster.pretrain_stuck`: lower it. Must be > 0."""
    pretrain_epochs: int = 0
    """Epochs of server-side pre-training of each cluster model on its pretrain pool. 0 = auto: enough to see about 10,000 samples, within [5, 50] (5 for the paper's 2000 per cluster; 24 for digits' 418 at K = 3); from `init` or a start model about 2,000, within [1, 10]. Must be >= 0."""
    pretrain_max_seconds: float = 150.0
    """Seconds all server-side pre-training may take (a cold start within about 3 minutes on 2 cores), shared by its models by planned samples; one out of time stops, logs `pretrain.budget_spent` and is not cached. The real-size scenarios set 0. Must be >= 0 (0 = no limit)."""
    start_epochs: int = 15
    """Epochs of the start model's training on data.public_images (cosine rate from pretrain_lr, batch 64). Must be >= 1."""
    start_augment: str = "crop+flip"
    """Augmentation of the start model's public images each epoch: crop (shift by up to an eighth of the side, zero padded), flip (mirror left-right), crop+flip (natural images) or none. Digits and text: crop (a mirrored digit is another sign)."""
    start_max_seconds: float = 600.0
    """Seconds the start model's training may take; one out of time stops at its next batch, logs `start.budget_spent` and is not cached. Must be >= 0 (0 = no limit)."""
    init: str = ""
    """A starting checkpoint (`--init FILE`): a torch state dict (.pt) or the raw float32 vector (.f32), used in place of the random init and shared pre-training. A new state dir only; empty = random init. docs/models.md#start-from-your-own-weights."""
    accuracy_every: int = 10
    """Epochs between refreshes of the per-cluster proxy accuracy metric (0 = after every batch that applied an upload). Must be >= 0."""
    snapshot_every: int = 200
    """Journal records between snapshots (a snapshot bounds replay time after a crash). Must be >= 1."""
    snapshot_journal_ratio: float = 1.0
    """Also snapshot when the journal since the last snapshot outgrows this multiple of that snapshot (and snapshot_journal_min_mb), so large records (12 MB an upload for MobileNetV3-small) keep the state dir within about 5x the state. A multiple >= 0; 0 = records only. docs/reliability.md."""
    snapshot_journal_min_mb: float = 64.0
    """The journal size in MB below which snapshot_journal_ratio never snapshots, so a small state is not rewritten every few uploads. Must be >= 0."""
    norm_bound: float = 0.0
    """Longest step ||v - base|| applied as sent, in parameter-space L2 units (0 = off); a longer one is scaled down to it and applied (`bounded.norm_bound`). Must be >= 0."""
    norm_factor: float = 4.0
    """Longest step applied as sent, as a multiple of the fleet's typical step (median of the latest applied, at most 3 per agent, never below half its peak), >= 0 (0 = off); a longer one is scaled down to it (`bounded.norm_outlier`). docs/reliability.md."""
    loss_margin: float = 0.0
    """Refuse an upload whose lowest mean loss over the K proxy sets exceeds that of its start model by more than this many nats (`loss_outlier`; >= 0, 0 = off). Catches sign-flipped updates; costs two proxy forward passes per upload. docs/reliability.md."""
    norm_window: int = 100
    """How many of the latest applied uploads' distances the norm_factor median is taken over. Must be >= 1."""
    norm_warmup: int = 10
    """Applied uploads needed before norm_factor acts (the median needs a fleet to be meaningful). Must be >= 0."""
    reply_workers: int = 0
    """CDFL: reply worker processes this aggregator starts on its own machine (`--workers N`, integer >= 0); each trains the replies handed to it over the broker, while the aggregator alone writes the clusters and journal (docs/scaling.md). 0 = replies train in the aggregator."""
    reply_pool: bool = False
    """CDFL: hand trained replies to reply workers that announce themselves on the broker (`fedmq worker`, on this or other machines), training a reply here only while none is online. On by itself when reply_workers > 0."""
    derived_logins: bool = True
    """When the broker URL names a user, reply connections and workers log in as USER-replies and USER-worker-I with passwords derived from USER's (`fedmq creds --workers N`), since prod.conf keys sessions by user. false: they log in as USER."""
    worker_threads: int = 0
    """Torch threads of each worker started by reply_workers (0 = the machine's cores divided among them). Must be >= 0."""
    worker_timeout_s: float = 300.0
    """A reply job not answered within this many seconds is given to another worker (or trained here), and its worker gets no more jobs until it announces itself again. Above a reply's worst training time: 6.4 s on cnn28 on a CPU core, about a minute for torchvision:mobilenet_v3_small. Must be > 0."""


@dataclass
class AgentSettings:
    """One edge agent (`fedmq agent`): identity, drift detection, local training, inference, data."""

    id: str = ""
    """Agent id (also its MQTT client id suffix and topic level); required to run an agent."""
    algorithm: str = "cdfl"
    """cdfl, fedsoft-async (the agent downloads all K models and estimates alpha), local (never talks to a server), or catafed, fedavg, fedprox, tifl (deadline rounds, docs/catafed.md)."""
    profile: str = "device"
    """Device profile: car, phone or device (always online); it gates uploads and drives the dataset source's mixture."""
    state_dir: str = ""
    """Model, tau, pending upload, detector state and counters (agent_state.msgpack) and model.onnx; a restart resumes from here. Empty = state/agent-ID, one per agent id. One agent at a time: a second on the same dir exits, naming the first's pid. Round agents keep no state."""
    detector: str = "threshold"
    """Drift detector: threshold, page_hinkley, adwin or ddm (edge_agent/drift.py DETECTORS; docs/edge_agent.md)."""
    detector_knobs: list[str] = field(default_factory=list)
    """The detector's knobs as name=value items, e.g. window=100,delta=0.15 (numbers only)."""
    min_update_interval_s: float = 60.0
    """Fewest seconds between two drift-triggered uploads (a manual trigger ignores it). Must be >= 0."""
    buffer_size: int = 1000
    """Newest labelled samples kept: the local training set and the data a new model is scored on. Must be >= 1."""
    min_samples_to_train: int = 200
    """Drift waits until the buffer holds this many samples before training. Must be >= 1."""
    samples_after_drift: int = 100
    """Samples to collect after a drift is detected before training: they describe the new data. Must be >= 0."""
    train_on_newest: int = 0
    """Train on only the newest N buffered samples (0 = all): after a shift, older samples describe the old mixture. Must be >= 0."""
    epochs: int = 2
    """Local epochs per update. Must be >= 1."""
    batch_size: int = 32
    """Local mini-batch size. Must be >= 1. A batch-norm model's last batch, if under half of this, joins the one before it (docs/models.md#batch-norm-what-travels-what-is-averaged-what-stays-local)."""
    lr: float = 0.01
    """Local learning rate. Must be > 0."""
    optimizer: str = "sgd"
    """sgd or adam."""
    momentum: float = 0.9
    """SGD momentum. Must be in [0, 1)."""
    weight_decay: float = 0.0
    """L2 weight decay of the local optimizer. Must be >= 0."""
    keep_local_bn: bool = False
    """FedBN: keep this device's own batch-norm weights, biases and running statistics when installing a reply (the first model is installed whole); uploads still carry them. No effect on a model without batch norm. docs/models.md#batch-norm-what-travels-what-is-averaged-what-stays-local."""
    rho: float = 0.1
    """Proximal weight: local loss + (rho/2)||v - u||^2 (FedSoft-Async: toward each cluster model, weighted by alpha). Must be >= 0."""
    send_sketch: bool = True
    """Send a 2 KB sketch of the training inputs with each CDFL upload (mean random Fourier features, fedmq/sketch.py): the aggregator's sketch estimator fits the mixture to it. It is an average of the inputs' features, no label; of few samples it reveals the samples themselves (sketch_min_samples)."""
    sketch_min_samples: int = 100
    """Send no sketch of fewer training samples than this (integer >= 0); the aggregator then estimates the mixture from the model. A sketch of 10 images can be inverted, one of 100 barely (docs/privacy.md)."""
    max_train_seconds: float = 120.0
    """Local training stops at the first batch past this budget (0 = no limit). Must be >= 0."""
    inference: str = "onnx"
    """onnx (ONNX Runtime, torch as the fallback) or torch."""
    onnx_exporter: str = "auto"
    """auto (dynamo, then legacy), dynamo or legacy."""
    onnx_threads: int = 1
    """ONNX Runtime intra-op threads (a device runs other things). Must be >= 0."""
    source: str = "dataset"
    """dataset (rotation clusters of data.dataset, mixture from the profile) or directory (files dropped into source_dir)."""
    source_dir: str = ""
    """Folder the directory source reads (<dir>/<label>/<name>.png|.npy)."""
    time_scale: float = 1.0
    """Profile seconds per wall-clock second for the dataset source (e.g. 60 replays a car's hour in a minute). Must be > 0."""
    poll_interval_s: float = 1.0
    """Seconds between polls of the data source. Must be >= 0."""
    poll_batch: int = 20
    """Most samples taken per poll. Must be >= 1."""
    reply_timeout_s: float = 20.0
    """An unanswered request is re-sent (same msg_id) after this many seconds, plus twice the reply time the aggregator's latest receipt announced (docs/protocol.md). Must be > 0."""
    save_every_s: float = 10.0
    """Longest time between state saves while nothing else changes (detector state, counters). Must be >= 0."""

    def state_path(self) -> str:
        """The state dir: state_dir, or state/agent-ID when empty, so that agents started side by
        side without --state-dir (the README's) never share one."""
        return self.state_dir or f"state/agent-{self.id}"


@dataclass
class PrivacySettings:
    """Differential privacy of what an agent sends (fedmq/privacy.py, docs/privacy.md)."""

    epsilon: float = 0.0
    """The agent's lifetime DP budget (record level; > 0 turns on DP-SGD and noises the sketch or mixture estimate on the device; uploading stops when the next upload would spend more). 0 = DP off (the default). docs/privacy.md. Must be >= 0."""
    delta: float = 1e-5
    """The delta of the (epsilon, delta) guarantee. Must be in (0, 1)."""
    clip: float = 1.0
    """DP-SGD: L2 norm each sample's gradient is clipped to. Must be > 0."""
    noise_multiplier: float = 1.0
    """DP-SGD: the noise added to a batch's summed gradients has standard deviation this x clip. Must be >= 0 (> 0 with DP on)."""
    sketch_noise_multiplier: float = 1.0
    """Sketch noise: its standard deviation is this x 2 sqrt(1024) / n for n samples. Must be >= 0 (> 0 with DP on)."""
    alpha_noise_multiplier: float = 1.0
    """FedSoft-Async's mixture estimate: noise of standard deviation this x sqrt(2) on each cluster's count of samples. Must be >= 0 (> 0 with DP on)."""
    batch_size: int = 128
    """DP-SGD's batch (0: agent.batch_size). Its noise on the mean gradient is noise_multiplier x clip / batch, so a larger batch drowns less signal; measured on digits at epsilon 4, an agent's own trained model reached 0.929 with 128 against 0.884 with 32 (docs/privacy.md). Must be >= 0."""
    uploads: int = 10
    """N > 0: spread the budget over N uploads; the noise multipliers are then set to the smallest common value with which N uploads fit in epsilon (`fedmq privacy plan` prints it). 0: use the multipliers as set. Must be >= 0."""

    def mechanisms(self, seed: int | None = None, *, plan: dict[str, Any] | None = None) -> UplinkPrivacy:
        """The agent's mechanisms and accountant; ConfigError for values out of range.

        With privacy.uploads, `plan` (n, batch_size, epochs, sketch, alpha: what one upload
        is) sets the noise multipliers by `fedmq.privacy.plan_noise`."""
        from fedmq.privacy import UplinkPrivacy

        try:
            if self.uploads < 0:
                raise ValueError(f"uploads must be >= 0, got {self.uploads}")
            if self.batch_size < 0:
                raise ValueError(f"batch_size must be >= 0, got {self.batch_size}")
            mechanisms = UplinkPrivacy(self.epsilon, self.delta, self.clip, self.noise_multiplier,
                                       self.sketch_noise_multiplier, self.alpha_noise_multiplier,
                                       self.batch_size, seed)
            if mechanisms.enabled and self.uploads and plan is not None:
                mechanisms = mechanisms.planned(uploads=self.uploads, **plan)
            return mechanisms
        except ValueError as exc:
            raise ConfigError(f"privacy: {exc}") from None


@dataclass
class MetricsSettings:
    """The aggregator's Prometheus endpoint (`--metrics-port`); docs/deploy.md lists the metrics."""

    port: int = 0
    """HTTP port serving /metrics; 0 = no endpoint. Must be in [0, 65535]."""
    host: str = "127.0.0.1"
    """Address the endpoint binds to; 0.0.0.0 in a container, so that Prometheus can reach it."""


@dataclass
class LogSettings:
    """Structured logs on stderr: a few lines of progress by default, every event on request."""

    level: str = "auto"
    """debug, info, progress, warning or error. auto: progress for `fedmq agent` and `fedmq aggregator` (one line per cycle step / applied upload, docs/deploy.md#logs), warning for the simulator, demo and tools (many agents in one process)."""
    json: bool = False
    """One JSON object per line (for log shippers)."""
    summary_every_s: float = 10.0
    """Aggregator: length of a progress window; one summary line (uploads/s, stale, refused, epoch) closes a window in which uploads went without a line of their own or uploads were refused. Must be > 0."""
    upload_lines: int = 10
    """Aggregator: applied uploads given a progress line of their own per summary window (0: summaries only); the rest are counted in the summary. Must be >= 0."""


@dataclass
class Config:
    """Every knob of every role; sections are added as roles grow."""

    fleet: str = "default"
    """Fleet name: the second topic level, fedmq/{fleet}/..."""
    model: str = "auto"
    """A zoo name (digits-cnn, cnn28, cnn32, cnn32-10, resnet20, resnet20-gn), auto (from the dataset), torchvision:NAME[?key=value&...] or module.path:factory[?key=value&...] (your nn.Module). Agent and aggregator must name the same model (spec hash). docs/models.md."""
    device: str = "auto"
    """auto, cpu or cuda for torch work."""
    seed: int = 0
    """Seed for everything random: model init, data draws, simulated arrivals."""
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    protocol: ProtocolSettings = field(default_factory=ProtocolSettings)
    codec: CodecSettings = field(default_factory=CodecSettings)
    data: DataSettings = field(default_factory=DataSettings)
    log: LogSettings = field(default_factory=LogSettings)
    cdfl: CDFLSettings = field(default_factory=CDFLSettings)
    catafed: CataFedSettings = field(default_factory=CataFedSettings)
    fedavg: FedAvgSettings = field(default_factory=FedAvgSettings)
    tifl: TiflSettings = field(default_factory=TiflSettings)
    fedasync: FedAsyncSettings = field(default_factory=FedAsyncSettings)
    fedbuff: FedBuffSettings = field(default_factory=FedBuffSettings)
    aggregator: AggregatorSettings = field(default_factory=AggregatorSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)


RANGES: dict[str, str] = {
    "broker.keepalive_s": ">= 1", "broker.max_inflight": "in [1, 65535]",
    "broker.reconnect_min_s": "> 0", "broker.reconnect_max_s": "> 0", "broker.session_expiry_s": ">= 0",
    "protocol.max_message_bytes": ">= 1", "protocol.chunk_bytes": ">= 1", "protocol.chunk_timeout_s": "> 0",
    "protocol.max_pending_bytes": ">= 1", "protocol.max_chunks": ">= 1", "protocol.max_partials_per_sender": ">= 1",
    "codec.int8_block": ">= 1", "codec.topk_ratio": "in (0, 1]",
    "data.min_samples": ">= 1", "data.max_samples": ">= 1", "data.primary_min": "in [0, 1]",
    "data.primary_max": "in [0, 1]", "data.proxy_per_cluster": ">= 0", "data.pretrain_per_cluster": ">= 0",
    "data.public_images": ">= -1",
    "cdfl.clusters": ">= 1", "cdfl.tau0": ">= 0", "cdfl.staleness_cap": ">= 0", "cdfl.beta0": "in [0, 1]",
    "cdfl.hinge_a": ">= 0", "cdfl.hinge_b": ">= 0", "cdfl.temperature": "> 0", "cdfl.proxy_batch": ">= 1",
    "cdfl.estimator_floor": "in [0, 1]", "cdfl.sketch_floor": "in [0, 1]", "cdfl.sketch_shrinkage": "in (0, 1]",
    "cdfl.trajectory_epochs": ">= 0", "cdfl.trajectory_lr": "> 0", "cdfl.trajectory_rho": ">= 0",
    "cdfl.eval_workers": ">= 0", "cdfl.eval_chunk": ">= 0",
    "cdfl.personalize_epochs": ">= 0", "cdfl.personalize_lr": "> 0", "cdfl.personalize_batch_size": ">= 1",
    "cdfl.personalize_min_steps": ">= 0", "cdfl.personalize_tail_average": "in [0, 1]",
    "cdfl.personalize_rho": ">= 0", "cdfl.personalize_mixture_guard": ">= 0", "cdfl.personalize_samples": ">= 0", "cdfl.reply_batch": ">= 0", "cdfl.reply_share": "in [0, 1]",
    "cdfl.personalize_head_above": ">= 0",
    "cdfl.personalize_kd_weight": "in [0, 1]", "cdfl.personalize_temperature": "> 0",
    "cdfl.update_power": "> 0", "cdfl.server_lr": ">= 0", "cdfl.server_lr_ramp": ">= 0", "cdfl.delta_hinge_a": ">= 0", "cdfl.delta_tau0": ">= 0",
    "cdfl.cluster_refresh_steps": ">= 0", "cdfl.cluster_refresh_lr": "> 0",
    "cdfl.direction_guard": ">= 0", "cdfl.cluster_average": "in [0, 1)", "cdfl.reply_average": "in [0, 1)",
    "catafed.groups": ">= 1", "catafed.per_group": ">= 1", "catafed.min_agents": ">= 0",
    "catafed.deadline_s": "> 0", "catafed.grace_s": ">= 0", "catafed.rounds": ">= 1",
    "catafed.target_accuracy": "in [0, 1]", "catafed.pf_window": ">= 1", "catafed.pf_initial": ">= 0",
    "catafed.min_shard": ">= 1", "catafed.epochs": ">= 1", "catafed.batch_size": ">= 1", "catafed.lr": "> 0",
    "catafed.eps_initial_s": ">= 0", "catafed.eps_factor": ">= 0", "catafed.eps_min_s": ">= 0",
    "catafed.recluster_every": ">= 0",
    "fedavg.clients_per_round": ">= 1", "fedavg.epochs": ">= 1", "fedavg.batch_size": ">= 1", "fedavg.lr": "> 0",
    "fedavg.momentum": "in [0, 1)", "fedavg.prox_mu": ">= 0",
    "fedasync.mixing": "in (0, 1]", "fedasync.hinge_a": ">= 0", "fedasync.hinge_b": ">= 0",
    "fedasync.staleness_cap": ">= 0",
    "fedbuff.buffer_size": ">= 1", "fedbuff.server_lr": "> 0", "fedbuff.staleness_exponent": ">= 0",
    "fedbuff.staleness_cap": ">= 0",
    "tifl.tiers": ">= 1", "tifl.interval": ">= 1", "tifl.credits": ">= 0",
    "aggregator.max_batch": ">= 1", "aggregator.inbox_max_messages": ">= 1", "aggregator.inbox_max_bytes": ">= 1",
    "aggregator.status_every_s": ">= 0", "aggregator.takeover_grace_s": ">= 0", "aggregator.heartbeat_s": "in [0.1, 60]",
    "aggregator.max_queued_per_agent": ">= 0", "aggregator.pretrain_epochs": ">= 0",
    "aggregator.pretrain_lr": "> 0", "aggregator.pretrain_max_seconds": ">= 0",
    "aggregator.start_epochs": ">= 1", "aggregator.start_max_seconds": ">= 0",
    "aggregator.accuracy_every": ">= 0", "aggregator.snapshot_every": ">= 1",
    "aggregator.snapshot_journal_ratio": ">= 0", "aggregator.snapshot_journal_min_mb": ">= 0", "aggregator.norm_bound": ">= 0",
    "aggregator.norm_factor": ">= 0", "aggregator.loss_margin": ">= 0", "aggregator.norm_window": ">= 1",
    "aggregator.norm_warmup": ">= 0", "aggregator.reply_workers": ">= 0", "aggregator.worker_threads": ">= 0",
    "aggregator.worker_timeout_s": "> 0",
    "agent.min_update_interval_s": ">= 0", "agent.buffer_size": ">= 1", "agent.min_samples_to_train": ">= 1",
    "agent.samples_after_drift": ">= 0", "agent.train_on_newest": ">= 0", "agent.epochs": ">= 1",
    "agent.batch_size": ">= 1", "agent.lr": "> 0", "agent.momentum": "in [0, 1)", "agent.weight_decay": ">= 0",
    "agent.rho": ">= 0", "agent.sketch_min_samples": ">= 0", "agent.max_train_seconds": ">= 0",
    "agent.onnx_threads": ">= 0", "agent.time_scale": "> 0", "agent.poll_interval_s": ">= 0",
    "agent.poll_batch": ">= 1", "agent.reply_timeout_s": "> 0", "agent.save_every_s": ">= 0",
    "privacy.epsilon": ">= 0", "privacy.delta": "in (0, 1)", "privacy.clip": "> 0", "privacy.noise_multiplier": ">= 0",
    "privacy.sketch_noise_multiplier": ">= 0", "privacy.alpha_noise_multiplier": ">= 0",
    "privacy.batch_size": ">= 0", "privacy.uploads": ">= 0",
    "metrics.port": "in [0, 65535]", "log.summary_every_s": "> 0", "log.upload_lines": ">= 0",
}
"""Dotted key -> the range its value must lie in (`>= X`, `> X`, or `in [a, b]` with `(`/`)` for
open ends); each key's docstring says the same words. `check_config` checks them at load: a
value that would crash minutes later is refused, with one line, before anything starts."""


def in_range(value: float, need: str) -> bool:
    """Whether `value` lies in the range `need` is written as (a value of RANGES)."""
    if need.startswith(">="):
        return value >= float(need[2:])
    if need.startswith(">"):
        return value > float(need[1:])
    lo, hi = (float(x) for x in need[4:-1].split(","))
    return ((lo <= value) if need[3] == "[" else (lo < value)) and ((value <= hi) if need[-1] == "]" else (value < hi))


def check_section(obj: Any, section: str) -> None:
    """ConfigError naming the first key of [section] (the dataclass `obj`) out of its range."""
    for key, need in RANGES.items():
        where, _, name = key.partition(".")
        if where == section and not in_range(getattr(obj, name), need):
            raise ConfigError(f"{key} must be {need}, got {getattr(obj, name)}")


START_AUGMENTS = ("crop+flip", "crop", "flip", "none")
"""The values aggregator.start_augment takes."""


def check_config(cfg: Config) -> None:
    """ConfigError naming the first key out of its range (RANGES, and the pairs that must be
    ordered), or an unknown dataset: said at load, `--dry-run` included, not as a traceback later."""
    for f in dataclasses.fields(cfg):
        if dataclasses.is_dataclass(getattr(cfg, f.name)):
            check_section(getattr(cfg, f.name), f.name)
    pairs = (("data.max_samples", cfg.data.max_samples, "data.min_samples", cfg.data.min_samples),
             ("data.primary_max", cfg.data.primary_max, "data.primary_min", cfg.data.primary_min),
             ("broker.reconnect_max_s", cfg.broker.reconnect_max_s, "broker.reconnect_min_s", cfg.broker.reconnect_min_s))
    for high, hv, low, lv in pairs:
        if hv < lv:
            raise ConfigError(f"{high} must be >= {low} ({lv}), got {hv}")
    resolve_trunk_share(cfg.cdfl.trunk_share, cfg.cdfl.clusters)
    if cfg.aggregator.start_augment not in START_AUGMENTS:
        raise ConfigError(f"aggregator.start_augment must be one of {', '.join(START_AUGMENTS)}, "
                          f"got {cfg.aggregator.start_augment!r}")
    from fedmq.protocol import ProtocolError, validate_id

    canonical_dataset(cfg.data.dataset)  # UnknownDataset (a usage error) lists the known ones
    for key, value in (("fleet", cfg.fleet), ("agent.id", cfg.agent.id)):
        try:  # ids are topic levels and directory names (agent.state_path)
            if value or key == "fleet":
                validate_id(value, key)
        except ProtocolError as e:
            raise ConfigError(e.message) from None


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Turn a TOML value or a CLI string into `typ`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or value == "":
            return None
        return _coerce(value, args[0], key)
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(typ) or (str,)
        items = value.split(",") if isinstance(value, str) else list(value)
        return [_coerce(v, inner, key) for v in items if v != ""]
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typ is int:
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}") from None
    return value


def _set(obj: Any, dotted: str, value: Any) -> None:
    if dotted in MOVED_KEYS:
        raise ConfigError(f"{dotted} moved: set {MOVED_KEYS[dotted]} instead")
    parts = dotted.split(".")
    target = obj
    for i, name in enumerate(parts):
        hints = typing.get_type_hints(type(target))
        if name not in hints:
            where = ".".join(parts[:i]) or "top level"
            prefix = ".".join(parts[:i]) + "." if i else ""
            close = difflib.get_close_matches(name, list(hints), n=1, cutoff=0.6)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {', '.join(sorted(hints))}"
            raise ConfigError(f"unknown config key {dotted!r} in {where}; {hint} (docs/config.md lists every key)")
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(hints[name]):
                raise ConfigError(f"{dotted} is a section; set one of its keys")
            setattr(target, name, _coerce(value, hints[name], dotted))
        else:
            target = getattr(target, name)
            if not dataclasses.is_dataclass(target):
                raise ConfigError(f"{'.'.join(parts[: i + 1])} is not a section")


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    base: Config | None = None,
) -> Config:
    """Defaults, then the TOML file at `path`, then `overrides` (dotted keys); ConfigError for a
    value out of its range (`check_config`)."""
    cfg = base or Config()
    if path:
        p = Path(path)
        try:
            table = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        for key, value in _flatten(table).items():
            _set(cfg, key, value)
    for key, value in (overrides or {}).items():
        _set(cfg, key, value)
    check_config(cfg)
    return cfg


def config_from_dict(doc: dict[str, Any]) -> Config:
    """A Config from `dataclasses.asdict` of one (what a parent process hands its children)."""
    return load_config(None, {k: v for k, v in _flatten(doc).items() if v is not None})


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """`["a.b=1", "c=x"]` from repeated `--set` flags into a dict."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


# Flags every role shares; each maps onto a dotted config key.
COMMON_FLAGS: dict[str, str] = {
    "broker": "broker.url",
    "fleet": "fleet",
    "ca_file": "broker.ca_file",
    "cert_file": "broker.cert_file",
    "key_file": "broker.key_file",
    "log_level": "log.level",
    "device": "device",
    "data_dir": "data.data_dir",
    "dataset": "data.dataset",
    "model": "model",
    "seed": "seed",
    "download": "data.download",
}


def add_config_arguments(parser: Any, flags: tuple[str, ...] = ("broker", "fleet", "log_level")) -> None:
    """`--config`, `--set` and the chosen shared flags; defaults come from Config, not argparse."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file with any config keys")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                        help="override one config key, e.g. --set codec.name=fp16 (repeatable)")
    helps = {
        "broker": ("URL", "mqtt://[user[:pass]@]host[:port] or mqtts://... (default mqtt://127.0.0.1:1883); "
                          "a user without a password reads it from FEDMQ_BROKER_PASSWORD"),
        "fleet": ("NAME", "fleet name, the topic prefix fedmq/NAME/ (default: default)"),
        "ca_file": ("PEM", "CA certificate that signed the broker's (mqtts)"),
        "cert_file": ("PEM", "client certificate (mutual TLS)"),
        "key_file": ("PEM", "client key (mutual TLS)"),
        "log_level": ("LEVEL", "debug, info, progress, warning or error (default auto: progress for agent and aggregator)"),
        "device": ("DEV", "auto (default), cpu or cuda"),
        "data_dir": ("DIR", "dataset root in torchvision's layout (default: $FEDMQ_DATA_DIR or ~/.cache/fedmq/data)"),
        "dataset": ("NAME", "digits (offline, default), synthetic or shapes (offline, generated), mnist, fashionmnist, cifar10, cifar100, svhn, usps, folder:NAME, module.path:factory"),
        "model": ("NAME", "zoo name, auto (default), torchvision:NAME[?k=v&...] or module.path:factory (docs/models.md)"),
        "seed": ("N", "random seed (default 0)"),
    }
    for name in flags:
        if name == "download":
            parser.add_argument("--download", action="store_true", default=None,
                                help="let torchvision download a missing dataset into --data-dir")
            continue
        metavar, text = helps[name]
        parser.add_argument("--" + name.replace("_", "-"), dest=name, metavar=metavar, help=text)


def config_from_args(args: Any, extra: dict[str, str] | None = None) -> Config:
    """Defaults < --config file < shared flags and `extra` (attr -> key) < --set."""
    overrides: dict[str, Any] = {}
    for attr, key in {**COMMON_FLAGS, **(extra or {})}.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides[key] = value
    flags = {key: "--" + {"agent_id": "id"}.get(attr, attr).replace("_", "-") for attr, key in
             {**COMMON_FLAGS, **(extra or {})}.items() if getattr(args, attr, None) is not None}
    settings = parse_overrides(getattr(args, "set", None))
    overrides.update(settings)
    try:
        cfg = load_config(getattr(args, "config", None), overrides)
    except ConfigError as e:  # name the flag that was typed: `--workers (aggregator.reply_workers) must be ...`
        key, _, rest = str(e).partition(" ")
        if key in flags and key not in settings:
            raise ConfigError(f"{flags[key]} ({key}) {rest}") from None
        raise
    data_dir = getattr(args, "data_dir", None)
    if data_dir and getattr(args, "scenario", None) is None:  # a scenario names its own dataset
        cfg.data.dataset = dataset_for_data_dir(cfg.data.dataset if dataset_named(args) else None, data_dir)
    return cfg


def dataset_named(args: Any) -> bool:
    """Whether the command line or its config file names data.dataset (`--dataset`, `--set
    data.dataset=...`, a `--config` that sets it): else an explicit `--data-dir` picks it."""
    flags = {key for attr, key in COMMON_FLAGS.items() if getattr(args, attr, None) is not None}
    keys = flags | set(parse_overrides(getattr(args, "set", None)))
    return "data.dataset" in keys or "data.dataset" in _file_keys(getattr(args, "config", None))


def _file_keys(path: str | os.PathLike[str] | None) -> set[str]:
    """The dotted keys a TOML config file sets (load_config has checked it already)."""
    return set(_flatten(tomllib.loads(Path(path).read_text()))) if path else set()


def dry_run_json(cfg: Config) -> str:
    """What `--dry-run` prints: the resolved config as JSON, checked as a start would check
    it (a bad broker URL fails here), the broker password masked."""
    import json

    from fedmq.logs import mask_secrets
    from fedmq.models import resolve_dataset_and_model  # torch: counts by building the model

    parse_broker_urls(cfg.broker.url)
    cfg.privacy.mechanisms()  # out-of-range DP settings fail here, as at a start
    doc = dataclasses.asdict(cfg)
    doc["broker"]["url"] = mask_secrets(cfg.broker.url)
    return json.dumps({**doc, "resolved": resolve_dataset_and_model(cfg.data.dataset, cfg.model)}, indent=2)
