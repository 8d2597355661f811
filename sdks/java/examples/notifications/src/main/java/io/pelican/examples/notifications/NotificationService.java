package io.pelican.examples.notifications;

import java.io.IOException;
import org.springframework.stereotype.Service;

/** The application's notification service (here a stand-in: the real one stores and pushes the notification). */
@Service
public class NotificationService {
    /** The subscriber no longer exists: the notification can never be sent. */
    public static class RecipientNotFoundException extends Exception {
        private static final long serialVersionUID = 1L;
    }

    /** Throws the provider's error (an {@link IOException}) while it is down. */
    public void send(long subscriberId, long targetId, String messageId) throws RecipientNotFoundException, IOException {
        System.out.printf("notified subscriber %d of target %d (%s)%n", subscriberId, targetId, messageId);
    }
}
