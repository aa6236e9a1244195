"""A user filter for the end-to-end test, loaded by import path in the processor's own process."""


def reject_every_third_prompt(samples):
    index = int(samples[0].prompt_id.rsplit("-", 1)[1])
    if index % 3 == 0:
        return False, f"prompt index {index} is a multiple of 3"
    return True, ""
