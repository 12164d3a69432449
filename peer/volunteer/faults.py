"""Where `peer join --die-at POINT` SIGKILLs a volunteer (fault injection for the tests), apart from
the worker so that `peer join` checks the flag before torch is imported. Each is a point of the
protocol where a death must still leave every micro-batch applied exactly once."""

KILL_POINTS = (
    "before_forward",
    "during_forward",
    "after_outputs",
    "during_backward",
    "after_input_grads",
    "mid_grad_push",
    "after_grad_push",
    "pulling_params",
)
