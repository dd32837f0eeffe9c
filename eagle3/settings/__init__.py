"""One typed settings model per component, a module per config section (``target``,
``store``, ``serve``, ``generate``, ``vocab``, ``extract``, ``drafter``, ``train``, ``evaluate``,
``kubernetes``), each field with a description. They are the config's schema: they import
no stage code, so :mod:`eagle3.config` composes them below every stage that reads them.
"""
