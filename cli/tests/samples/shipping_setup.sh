# Sourced by scenarios that start from a blocked key: subscription "shipping" (order.*,
# ordered, 1 attempt), whose ./ship.sh fails for order.paid; for the key order:42,
# order.placed is delivered, order.paid is a dead letter and order.shipped waits behind it.
pgbus migrate >/dev/null
cat >ship.sh <<'SH'
#!/bin/sh
cat > /dev/null
if [ "$PGBUS_EVENT_NAME" = order.paid ]; then
    echo "carrier api: 503" >&2
    exit 1
fi
SH
chmod +x ship.sh
