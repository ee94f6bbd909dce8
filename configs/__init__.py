"""The named model configs and recipes (``<name>.yaml``), installed as package data ``gdn2.configs``.

``gdn2.config.Config.from_name(name)`` reads a file's ``model:`` section, ``gdn2.train.recipe`` the
others.
"""
