"""Datasets, rotation clusters and per-agent mixtures (docs/data.md).

    train = load_dataset("digits")                      # offline; mnist etc. from --data-dir
    clusters = RotatedClusters(train, load_dataset("digits", train=False), 4, seed=0)
    proxy = clusters.proxy(0)                           # server-side, fixed by the seed
    local, local_test = draw_agent(clusters, np.random.default_rng(7))
"""

from fedmq.data.clusters import (
    PURPOSES,
    DatasetTooSmall,
    RotatedClusters,
    cluster_angles,
    clusters_from_settings,
    draw_from_pool,
    rotate,
)
from fedmq.data.mixtures import AgentData, draw_agent, draw_mixture, sample_agent_data, split_counts
from fedmq.data.sources import (
    DATASETS,
    Dataset,
    DatasetNotFound,
    clear_cache,
    dataset_for_data_dir,
    load_dataset,
)

__all__ = [
    "DATASETS",
    "PURPOSES",
    "AgentData",
    "Dataset",
    "DatasetNotFound",
    "DatasetTooSmall",
    "RotatedClusters",
    "clear_cache",
    "cluster_angles",
    "clusters_from_settings",
    "dataset_for_data_dir",
    "draw_agent",
    "draw_from_pool",
    "draw_mixture",
    "load_dataset",
    "rotate",
    "sample_agent_data",
    "split_counts",
]
