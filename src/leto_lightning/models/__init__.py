"""The compact MoE transformer used by the recipes, its configs and synthetic data.

Submodules are imported explicitly (nothing is re-exported here) so that importing
``leto_lightning.models.config`` (the simulator does) pulls in neither torch nor Lightning:

- ``config``: recipe dataclasses, ``load_recipe``, ``count_parameters`` (omegaconf only);
- ``moe_transformer``: the model in pure torch (no Lightning: used below the integration);
- ``data``: seeded synthetic token data and ``make_dataloaders``;
- ``lightning_module``: ``MoELanguageModel``, the LightningModule wrapper.
"""
