from decode_worker.cli import main

raise SystemExit(main())
