"""Who gets in and in what order: the peer gate (gate.py: the connection
cap, shedding, the memory watchdog; its sizes in caps.py, its sockets in
connections.py), the accept guard behind it (acceptguard.py, Linux), reply
budgets per peer (outbox.py) and whose request is served next (turns.py)."""
