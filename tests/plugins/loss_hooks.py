"""A user loss for the loss-hook test, loaded by import path (``trainer.loss``)."""
from milestream.train.losses import LossInput, LossOutput


def plain_policy_gradient(batch: LossInput) -> LossOutput:
    """REINFORCE without ratio or correction: -sum A log pi over the mask."""
    mask = batch.mask
    loss_sum = -(batch.advantages * batch.logp * mask).sum()
    return LossOutput(loss_sum, int(mask.sum()), {"advantage_mean": float((batch.advantages * mask).sum())})
