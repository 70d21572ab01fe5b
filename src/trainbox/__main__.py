from trainbox.cli import main

raise SystemExit(main())
