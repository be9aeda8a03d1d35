"""``HealthCallback`` for the ``pytorch_lightning`` package (Lightning 2.x under its older
name); see ``fasthealth.integrations.lightning``."""

from pytorch_lightning import Callback

from ._lightning import HealthCallbackMixin


class HealthCallback(HealthCallbackMixin, Callback):
    __doc__ = HealthCallbackMixin.__doc__
