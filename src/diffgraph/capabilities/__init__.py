"""The built-in capabilities' declarations, standard library only: one module per capability, each a `DECLARATION`
(capability_settings.py `Declaration`: its settings dataclass, its request parameters and their flags), found by
`capability_settings.builtin()`. The capabilities themselves live beside their families (models/families/)."""
