"""keras.optimizers for meshtune: AdamW (and Adam, AdamW without weight decay), with Keras'
arguments and exclude_from_weight_decay. The engine runs the update (spec §8: Keras' order of
operations, bit for bit)."""
from meshtune import _checks


class AdamW:
    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False, clipnorm=None, clipvalue=None, global_clipnorm=None, use_ema=False,
                 ema_momentum=None, ema_overwrite_frequency=None, loss_scale_factor=None,
                 gradient_accumulation_steps=None, name=None):
        if amsgrad:
            raise NotImplementedError("AdamW: amsgrad=True is not implemented by meshtune")
        if use_ema:
            raise NotImplementedError("AdamW: use_ema=True is not implemented by meshtune")
        _checks.not_implemented("AdamW", ema_momentum=ema_momentum, ema_overwrite_frequency=ema_overwrite_frequency,
                                loss_scale_factor=loss_scale_factor)
        if callable(learning_rate):
            raise NotImplementedError("AdamW: a learning-rate schedule object is not implemented by meshtune "
                                      "(give a number)")
        self.learning_rate = _checks.number("learning_rate", learning_rate, positive=True)
        self.weight_decay = _checks.number("weight_decay", weight_decay or 0.0, minimum=0.0)
        self.beta_1 = _checks.number("beta_1", beta_1, minimum=0.0)
        self.beta_2 = _checks.number("beta_2", beta_2, minimum=0.0)
        if self.beta_1 >= 1 or self.beta_2 >= 1:
            raise ValueError(f"AdamW: beta_1 and beta_2 must be in [0, 1), got {self.beta_1}, {self.beta_2}")
        self.epsilon = _checks.number("epsilon", epsilon, positive=True)
        self.clipnorm = None if clipnorm is None else _checks.number("clipnorm", clipnorm, positive=True)
        self.clipvalue = None if clipvalue is None else _checks.number("clipvalue", clipvalue, positive=True)
        self.global_clipnorm = None if global_clipnorm is None else _checks.number("global_clipnorm", global_clipnorm,
                                                                                   positive=True)
        self.gradient_accumulation_steps = (None if gradient_accumulation_steps is None else
                                            _checks.integer("gradient_accumulation_steps",
                                                            gradient_accumulation_steps, 1, 1 << 20))
        self.name = name or "adamw"
        self._exclude = []

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        if var_list is not None:
            raise NotImplementedError("exclude_from_weight_decay: var_list= is not implemented by meshtune (use "
                                      "var_names=, regexes searched in each variable's name)")
        if var_names is not None:
            self._exclude = _checks.strings("var_names", var_names)

    def _options(self):
        return {"learning_rate": self.learning_rate, "weight_decay": self.weight_decay, "beta_1": self.beta_1,
                "beta_2": self.beta_2, "epsilon": self.epsilon, "exclude_from_weight_decay": self._exclude,
                "clipnorm": self.clipnorm, "clipvalue": self.clipvalue, "global_clipnorm": self.global_clipnorm}


class Adam(AdamW):
    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, **kwargs):
        super().__init__(learning_rate=learning_rate, weight_decay=0.0, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, **kwargs)
        self.name = kwargs.get("name") or "adam"
