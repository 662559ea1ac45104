"""keras.callbacks for meshtune: Callback (the hooks fit calls between steps, with Keras' logs),
History (what fit returns), LambdaCallback, and BackupAndRestore (checkpoints that a later fit
resumes from, bit for bit)."""
import os

from meshtune import _checks


class Callback:
    def __init__(self):
        self.model = None
        self.params = {}

    def set_model(self, model):
        self.model = model

    def set_params(self, params):
        self.params = params

    def on_train_begin(self, logs=None):
        pass

    def on_train_end(self, logs=None):
        pass

    def on_epoch_begin(self, epoch, logs=None):
        pass

    def on_epoch_end(self, epoch, logs=None):
        pass

    def on_train_batch_begin(self, batch, logs=None):
        pass

    def on_train_batch_end(self, batch, logs=None):
        pass


class History(Callback):
    def __init__(self):
        super().__init__()
        self.epoch = []
        self.history = {}

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)

    def __repr__(self):
        return f"<meshtune.callbacks.History epochs={len(self.epoch)} keys={sorted(self.history)}>"


class LambdaCallback(Callback):
    def __init__(self, on_epoch_begin=None, on_epoch_end=None, on_train_begin=None, on_train_end=None,
                 on_train_batch_begin=None, on_train_batch_end=None):
        super().__init__()
        for name, fn in locals().items():
            if name.startswith("on_") and fn is not None:
                setattr(self, name, fn)


class BackupAndRestore(Callback):
    """fit writes a checkpoint into backup_dir (every `save_freq` steps, and at the end or when
    stopped); a later fit with the same callback resumes from it bit for bit."""

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=False, double_checkpoint=False):
        super().__init__()
        self.backup_dir = _checks.path("backup_dir", backup_dir)
        if save_freq != "epoch" and save_freq is not False:
            _checks.integer("save_freq", save_freq, 1)
        if delete_checkpoint:
            raise NotImplementedError("BackupAndRestore: delete_checkpoint=True is not implemented by meshtune")
        if double_checkpoint:
            raise NotImplementedError("BackupAndRestore: double_checkpoint=True is not implemented by meshtune")
        self.save_freq = save_freq

    @property
    def checkpoint_path(self):
        return os.path.join(self.backup_dir, "checkpoint.safetensors")
