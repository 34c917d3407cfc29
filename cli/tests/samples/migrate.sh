run pgbus migrate
run pgbus migrate
