"""The compact MoE transformer used by the recipes, its configs and synthetic data.

Submodules are imported explicitly (nothing is re-exported here), so that importing
``leto_lightning.models.config`` pulls in neither torch nor Lightning:

- ``config``: the recipe schema's names (``leto_lightning.recipes``: recipe dataclasses,
  ``load_recipe``, ``count_parameters``), which the simulator imports from ``recipes`` directly;
- ``moe_transformer``: the model in pure torch (no Lightning: used below the integration);
- ``data``: seeded synthetic token data and ``make_dataloaders``;
- ``lightning_module``: ``MoELanguageModel``, the LightningModule wrapper.
"""
