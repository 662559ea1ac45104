"""keras.losses for meshtune: the one loss the engine computes (on logits, in chunks that never
hold [tokens × vocabulary] at once)."""


class SparseCategoricalCrossentropy:
    def __init__(self, from_logits=False, ignore_class=None, reduction="sum_over_batch_size", name=None):
        if not from_logits:
            raise NotImplementedError("SparseCategoricalCrossentropy: meshtune computes the loss on logits "
                                      "(from_logits=True, as KerasHub's causal LMs use it)")
        if ignore_class is not None:
            raise NotImplementedError("SparseCategoricalCrossentropy: ignore_class= is not implemented by meshtune "
                                      "(padding is masked by sample weights)")
        if reduction not in ("sum_over_batch_size", "auto"):
            raise NotImplementedError(f"SparseCategoricalCrossentropy: reduction={reduction!r} is not implemented")
        self.from_logits = True
        self.name = name or "sparse_categorical_crossentropy"
