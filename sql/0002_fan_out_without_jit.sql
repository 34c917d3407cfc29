-- pgbus schema, version 2: the fan-out trigger never JIT-compiles.
--
-- The fan-out joins the new events with pgbus.subscriptions, a table of a few rows that
-- is rarely analyzed: until it is, the planner guesses hundreds of subscriptions, so a
-- batch of a thousand events or more is costed above jit_above_cost and every
-- publish_batch pays for compiling the query (hundreds of milliseconds for 10,000
-- events, more than the insert itself). The trigger's query is simple: interpreting it
-- is always cheaper than compiling it.
ALTER FUNCTION pgbus.fan_out() SET jit = off;
